"""Metrics, traces, logs and health: what the path emits, watched."""
