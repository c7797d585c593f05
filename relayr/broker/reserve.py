"""A worker's reserve: pool processes that a backlog's messages never fill.

A worker started with a reserve (``relayr worker --reserve``) sets the transport option
:data:`BEHIND_AT_MOST` to its ``--concurrency``: its consumer then holds at most that many
messages of a lower priority (a backlog's, sent *behind*) at once, and while it holds that many
takes only messages of the highest priority. The processes left over take a workspace's only
message the moment it comes, so it waits for no backlog's message to end (ADR-0128). Both
transports, Redis and the embedded broker, read the option.
"""

from collections.abc import Mapping
from typing import Any, Final

BEHIND_AT_MOST: Final = "behind_at_most"
"""The transport option: how many messages of a lower priority a consumer holds at most; unset,
as many as its prefetch allows."""


def behind_at_most(options: Mapping[str, Any]) -> int | None:
    """The option's value in kombu's transport options: a positive count, or None."""
    value = options.get(BEHIND_AT_MOST)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"transport option {BEHIND_AT_MOST} must be a positive count: {value!r}")
    return value


def is_behind(properties: Mapping[str, Any]) -> bool:
    """Whether a delivered message's properties give it a priority below the highest (0)."""
    return bool(properties.get("priority") or 0)
