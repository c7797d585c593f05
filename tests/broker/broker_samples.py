"""What a broker's queue can hold besides messages: the samples the broker tests drop in.

:data:`GARBAGE`: files and Redis entries that are not kombu messages (a write that never
finished, text, JSON of another shape); relayr's transports set each aside before kombu reads
it. :data:`NOT_TASKS`: kombu messages that are not Celery tasks a worker can read (Celery
raised on each, on kombu 5.7 and Celery 5.7: an unhashable task name stopped the worker, a
missing task id made it drop the connection); the transports' consumer guard sets them aside.
"""

import base64
import json
from typing import Any, Final


def envelope(body: object = "fine", *, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    """A kombu message as kombu's virtual transports store it."""
    return {
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {} if headers is None else headers,
        "properties": {
            "delivery_info": {"exchange": "", "routing_key": "queue"},
            "delivery_tag": "tag",
            "body_encoding": "base64",
            "priority": 0,
        },
    }


def _json(value: object) -> bytes:
    return json.dumps(value).encode()


GARBAGE: Final[dict[str, bytes]] = {
    "empty": b"",
    "truncated": _json(envelope())[:40],
    "not json": b"hello, world",
    "not utf-8": b"\xff\xfe\x00garbage",
    "a json list": b"[1, 2, 3]",
    "an object of something else": b'{"hello": "world"}',
    "no delivery_info": _json({**envelope(), "properties": {"delivery_tag": "tag"}}),
    "headers not an object": _json({**envelope(), "headers": [1]}),
    "body not base64": _json({**envelope(), "body": "%%%"}),
    "unknown json type tag": _json({**envelope(), "headers": {"__type__": "nope", "__value__": 1}}),
}
"""Each must be set aside by the transport; none may reach kombu's ``Message``."""

NOT_TASKS: Final[dict[str, bytes]] = {
    "unhashable task name": _json(envelope([[], {}, {}], headers={"task": ["relayr"]})),
    "task without an id": _json(
        envelope([["a", "b", "c"], {}, {}], headers={"task": "relayr.execute_run"})
    ),
}
"""Each must be set aside by the consumer guard; neither may stop or disconnect a worker."""
