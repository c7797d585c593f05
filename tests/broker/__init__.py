"""Tests of the embedded and Redis transports, with real worker processes."""
