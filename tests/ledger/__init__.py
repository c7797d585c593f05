"""Tests of the ledger: which run made each write, and a turn's cause."""
