"""Deciding: wake on new events, evaluate rules, hand due runs out to the workers."""
