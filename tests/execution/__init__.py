"""Tests of acting: the executor, a run's writes, real worker processes and faults."""
