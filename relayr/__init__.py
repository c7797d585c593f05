"""relayr: executes reflexr rule runs on Celery workers, each acting in artifactr as its rule.

Every write's id is derived from the run, so a retried task makes each effect once; rules post
notices by default, and start agent turns only where the operators' allowlist says so.
"""
