"""Tests of what ops do to runs."""
