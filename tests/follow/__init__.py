"""Tests of the followers that bring artifactr's events back into reflexr."""
