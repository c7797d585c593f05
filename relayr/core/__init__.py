"""relayr's pure core: what a run may do and how its writes are named, decided without I/O.

Ids (:mod:`~relayr.core.ids`), errors (:mod:`~relayr.core.errors`), emission records
(:mod:`~relayr.core.emissions`), the allowlist policy and its file's parsing
(:mod:`~relayr.core.allowlist`, :mod:`~relayr.core.allowlist_toml`), the decisions a rule's
write meets (:mod:`~relayr.core.routing`, :mod:`~relayr.core.refusals`) and the one list of
run-failure reasons (:mod:`~relayr.core.reasons`).

The core imports no I/O (no storage, no broker, no Celery, neither library), no clock, no
environment and nothing else of relayr: values in, decisions out. The engine around it
(``relayr.execution.actions``, ``relayr.execution.executor``, ...) loads, asks the core and writes.
The contract is checked by import-linter (pyproject.toml, ``make check``), so the core is tested
with tables and a fixed ``NOW``, without artifactr.
"""
