"""Tests of the repository as a whole: layers, deploy files, benchmarks, the example."""
