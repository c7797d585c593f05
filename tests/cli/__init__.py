"""Tests of the `relayr` command line."""
