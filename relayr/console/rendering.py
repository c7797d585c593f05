"""How the console's pages are rendered: its Jinja2 templates, their filters, its stylesheet.

Autoescape is always on, so nothing stored (a message, a rule name, an error) is ever rendered
as markup, and a variable a page does not give is an error, never an empty string. Every
template sees the runs filter's words (:mod:`relayr.console.queries`), the transcript's
markers, what a turn's status means (:mod:`relayr.console.reads`) and how long a login lasts
(:mod:`relayr.console.security`). The pages carry no script.
"""

from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import jinja2

from relayr.ops.report import TOOK
from relayr.ops.transcript import marker

from . import actions, reads
from .queries import ORDERS, PAGE_SIZE, STATUS_FILTERS, STATUS_HELP, href
from .security import SESSION_MAX_AGE_S

HERE: Final = Path(__file__).resolve().parent
TEMPLATES: Final = HERE / "templates"
STATIC: Final = HERE / "static"


def templates() -> jinja2.Environment:
    """The console's templates: autoescape always on, a missing variable an error."""
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.globals.update(
        href=href,
        marker=marker,
        STATUS_FILTERS=STATUS_FILTERS,
        STATUS_HELP=STATUS_HELP,
        ORDERS=ORDERS,
        PAGE_SIZE=PAGE_SIZE,
        SELECTED=actions.SELECTED,
        TURN_ADVICE=reads.TURN_ADVICE,
        TOOK=TOOK,
        SESSION_HOURS=SESSION_MAX_AGE_S // 3600,
    )
    environment.filters["age"] = age
    environment.filters["when"] = when
    environment.filters["seconds"] = seconds
    return environment


def age(then: datetime, now: datetime) -> str:
    """How long ago ``then`` was, in the largest whole unit: ``45 s``, ``12 min``, ``3 h``."""
    seconds = max(int((now - then).total_seconds()), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


def when(moment: datetime | None) -> str:
    """A moment in UTC, to the second; ``-`` for none."""
    if moment is None:
        return "-"
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def seconds(value: float | None) -> str:
    """A duration for people: ``0.4 s``, ``45 s``, ``12 min 5 s``, ``3 h 10 min``; ``-`` for
    none."""
    if value is None:
        return "-"
    if value < 10:
        return f"{value:.1f} s"
    whole = int(value)
    for unit, size, smaller, small_size in (
        ("d", 86400, "h", 3600),
        ("h", 3600, "min", 60),
        ("min", 60, "s", 1),
    ):
        if whole >= size:
            rest = (whole % size) // small_size
            return f"{whole // size} {unit}" + (f" {rest} {smaller}" if rest else "")
    return f"{whole} s"
