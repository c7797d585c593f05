"""Tests of deciding: evaluation, the dispatcher's hand-out, lost messages."""
