"""Tests of the pure core: ids, the allowlist's policy and parsing, routing, records."""
