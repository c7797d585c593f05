"""``relayr console``: an ops console in the browser, over the same engine calls as the CLI.

An on-call engineer opens it from an alert: the runs (dead ones with their reasons), a run
whole, a thread's transcript, the allowlist as it applies to every rule, and health. It reads
by default; with ``RELAYR_CONSOLE_TOKEN`` set, a logged-in person can retry, cancel and skip
runs, and retry the dead runs of a filter after a preview, each exactly as ``relayr runs``
does (ADR-0070).

- :mod:`relayr.console.app`: the Starlette app and its routes; :mod:`relayr.console.rendering`:
  its templates;
- :mod:`relayr.console.reads`: what the pages show; :mod:`relayr.console.actions`: what the
  buttons do; :mod:`relayr.console.queries`: what a URL may ask for;
  :mod:`relayr.console.forms`: what a form may name;
- :mod:`relayr.console.security`: token, session, CSRF, host and response headers.

Importing this package imports nothing: ``relayr console`` (:mod:`relayr.cli.console`) loads
Starlette, Jinja2 and uvicorn when it runs, so ``relayr --help`` never does (ADR-0050). Only
the command line and the tests import it.
"""
