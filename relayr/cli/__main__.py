"""``python -m relayr.cli``: the ``relayr`` command, in this interpreter (how relayr starts its
own worker subprocesses, :func:`relayr.cli.processes.relayr_command`)."""

from relayr.cli import main

main()
