"""The application of :mod:`bench.idle`: the example, plus an event no rule answers.

``RELAYR_APP=bench.idle_app:create_app``. Publishing :class:`Seen` into a workspace makes it
known to reflexr, so a dispatcher evaluates it, without making a run. (A module of its own:
reflexr registers an event type once per process, and ``python -m bench.idle`` must not define
it a second time as ``__main__``'s.)
"""

import dataclasses
from typing import Final

from reflexr import Event

from relayr.runtime.application import Application
from relayr.settings import Settings

APP: Final = "bench.idle_app:create_app"


class BenchEvent(Event, abstract=True, event_namespace="bench"):
    """Events only the benchmarks publish."""


class Seen(BenchEvent, name="seen"):
    """``bench:seen``: makes a workspace known to reflexr without a run (no rule answers it)."""


async def create_app(settings: Settings) -> Application:
    """The example, whose clients may publish :class:`Seen` as well."""
    from reflexr.workspace import Workspaces

    from relayr.follow.events import BRIDGED_EVENTS, PUBLISHERS
    from rules import example
    from rules.example.events import EVENTS
    from rules.example.rules import INBOUND_RULES, RULES

    app = await example.build_app(settings)
    rules = Workspaces(
        app.rules.storage,
        events=[*EVENTS, *BRIDGED_EVENTS, Seen],
        publishers=PUBLISHERS,
        rules=[*RULES, *INBOUND_RULES],
    )
    return dataclasses.replace(app, rules=rules)
