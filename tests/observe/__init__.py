"""Tests of metrics, traces, logs and health."""
