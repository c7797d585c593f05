"""The ops tests share a world of runs in every state, on real storage."""

from tests.ops.ops_harness import ops as ops
