"""relayr's pure core: what a run may do and how its writes are named, decided without I/O.

Ids, errors, emission records, the allowlist policy and its parsing, the decisions a rule's write
meets, and the one list of failure reasons. The core imports no I/O, no clock, no environment and
nothing else of relayr (an import-linter contract): values in, decisions out (ADR-0060).
"""
