"""A message a consumer cannot use is set aside with one log line; it never kills the consumer.

relayr's transports decode every message before kombu does (:func:`decode`) and wrap the
consumer's callback (:class:`SetAsideOnError`): a message that is not a kombu message, or that the
callback raised on, goes to the broker's dead letters with one ``broker message set aside`` line,
and the consumer goes on (ADR-0013). Connection errors are raised, for Celery to reconnect on.
"""

import base64
import binascii
from abc import ABC, abstractmethod
from typing import Any, Final

import structlog
from kombu.utils import json

loads: Any = json.loads  # kombu's annotations are partial: used untyped, as Any

logger = structlog.get_logger("relayr.broker")

SET_ASIDE: Final = "broker message set aside"
"""The log event of a dead-lettered message; its fields: ``path`` (where it now lies),
``queue``, ``problem``."""

MAX_PROBLEM_CHARS: Final = 300
"""A problem's text is cut here: a log line stays one readable line whatever the message."""


def decode(raw: bytes, channel: Any) -> tuple[dict[str, Any] | None, str | None]:
    """``raw`` as a kombu message payload, or None and the problem with it.

    A payload is accepted only if ``channel``'s own ``Message`` class can be built from it, so
    nothing that passes here can raise in kombu's delivery.
    """
    if not raw.strip():
        return None, "empty: a file or entry with nothing in it (a write that never finished?)"
    try:
        payload = loads(raw)
    except UnicodeDecodeError as error:
        return None, f"not UTF-8 text: {error}"
    except ValueError as error:
        return None, f"not JSON (truncated?): {error}"
    problem = problem_with(payload, channel)
    if problem is not None:
        return None, problem
    return payload, None


def problem_with(payload: object, channel: Any) -> str | None:
    """What keeps ``payload`` from being a kombu message on ``channel``, or None."""
    if not isinstance(payload, dict):
        return f"not a kombu message: JSON {type(payload).__name__}, not an object"
    properties = payload.get("properties")
    if not isinstance(properties, dict):
        return "not a kombu message: it has no properties object"
    if not isinstance(properties.get("delivery_info"), dict):
        return "not a kombu message: its properties have no delivery_info object"
    headers = payload.get("headers")
    if headers is not None and not isinstance(headers, dict):
        return "not a kombu message: its headers are not an object"
    body = payload.get("body")
    if properties.get("body_encoding") == "base64":
        # kombu's own decoding skips what is not base64 and reads garbage as an empty body
        try:
            base64.b64decode(body if isinstance(body, (str, bytes)) else b"?", validate=True)
        except (binascii.Error, ValueError):
            return "not a kombu message: its body is not base64, as its body_encoding says"
    try:
        channel.Message(payload, channel=channel)
    except Exception as error:  # whatever kombu cannot read is the problem, named
        return f"not a kombu message: {type(error).__name__}: {error}"
    return None


def log_set_aside(path: str, queue: str, problem: str) -> None:
    """The one line a dead-lettered message gets."""
    logger.error(SET_ASIDE, path=path, queue=queue, problem=problem[:MAX_PROBLEM_CHARS])


class SetAsideOnError(ABC):
    """A channel mixin: the consumer's callback cannot raise a message's fault into Celery.

    The channel supplies ``set_aside(message, queue, problem)``, which moves the delivered
    message to its dead letters and settles it, and ``connection`` (its kombu transport), whose
    connection and channel errors still propagate. A ``LookupError`` is the message's fault even
    where kombu counts it a connection error (Redis does, for a stale poller): raised from a
    callback, it comes from the message's content (Celery reads ``headers['id']``).
    """

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        transport = self.connection  # type: ignore[attr-defined]  # kombu's channel has it
        passing = tuple(
            error
            for error in (*transport.connection_errors, *transport.channel_errors)
            if not issubclass(error, LookupError)
        )

        def guarded(message: Any) -> Any:
            try:
                return callback(message)
            except passing:
                raise
            except Exception as error:  # the message's fault: set it aside, go on
                problem = f"its consumer could not handle it: {type(error).__name__}: {error}"
                self.set_aside(message, queue, problem)
                return None

        return super().basic_consume(  # type: ignore[misc]  # the kombu channel it is mixed into
            queue, no_ack, guarded, consumer_tag, **kwargs
        )

    @abstractmethod
    def set_aside(self, message: Any, queue: str, problem: str) -> None:
        """Move the delivered ``message`` to ``queue``'s dead letters and settle it."""
