"""Tests of the ops console: HTTP against the real app, and real Chromium."""
