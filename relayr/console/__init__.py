"""``relayr console``: an ops console in the browser, over the same engine calls as the CLI.

It shows runs, a run whole, a thread's transcript, the allowlist and health; with
``RELAYR_CONSOLE_TOKEN`` set, a logged-in person can retry, cancel and skip runs exactly as
``relayr runs`` does (ADR-0070). Importing this package imports nothing: Starlette, Jinja2 and
uvicorn load when ``relayr console`` runs (ADR-0050).
"""
