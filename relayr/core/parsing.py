"""What people type, read one way wherever they type it: ids, workspaces and durations.

The command line's arguments and the console's URL parameters take the same things, so they
check them here, and each turns :class:`Unreadable` into its own refusal (exit code 2, a 400
page) with the same words.
"""

import re
from datetime import timedelta
from typing import Final

from relayr.core.errors import RelayrError

ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
"""What a tenant, workspace, thread, run or event id typed by a person may look like: it keeps
accidents (spaces, slashes, empty parts) out of the store."""

_DURATION: Final = re.compile(r"(\d+)([smhd])")
_UNITS: Final = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


class Unreadable(RelayrError):
    """Raised when what a person typed is not what it should be; the message names it."""

    code = "bad_input"


def parse_id(what: str, text: str) -> str:
    """Check an id; ``what`` names it in the refusal (``THREAD``, ``run``)."""
    if not ID_PATTERN.fullmatch(text):
        raise Unreadable(f"{what} {text!r} is malformed: letters, digits and . _ : @ - only")
    return text


def parse_workspace(what: str, text: str) -> tuple[str, str]:
    """``TENANT/WORKSPACE`` as (tenant id, workspace id)."""
    tenant, slash, workspace = text.partition("/")
    if not slash or not ID_PATTERN.fullmatch(tenant) or not ID_PATTERN.fullmatch(workspace):
        raise Unreadable(
            f"{what} {text!r} is malformed: expected two ids joined by '/', such as acme/ops "
            "(letters, digits and . _ : @ -)"
        )
    return tenant, workspace


def parse_duration(what: str, text: str) -> timedelta:
    """``90s``, ``15m``, ``2h``, ``7d``, or a sum such as ``1h30m``."""
    parts = _DURATION.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise Unreadable(f"{what} {text!r} is not a duration such as 90s, 15m, 2h or 7d")
    total = timedelta()
    try:
        for number, unit in parts:
            total += timedelta(**{_UNITS[unit]: int(number)})
    except (OverflowError, ValueError):  # past what a timedelta holds
        raise Unreadable(
            f"{what} {text!r} is too long a duration: at most {timedelta.max.days}d"
        ) from None
    return total
