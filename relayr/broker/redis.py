"""kombu's Redis transport, with a consumer that sets aside an entry it cannot use (ADR-0013).

The channel's ``BRPOP`` replies are screened (redis-py's response callback) before kombu decodes
them: an entry that is not a kombu message, or that the consumer raised on or rejected, is pushed
onto ``<queue>.dead`` with one ``broker message set aside`` log line, and the consumer goes on.
Fanout messages and ``rediss://`` keep kombu's own handling.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

from kombu.transport import redis as kombu_redis
from kombu.utils import encoding, json

from relayr.broker.dead_letters import SetAsideOnError, decode, log_set_aside
from relayr.broker.reserve import BEHIND_AT_MOST, behind_at_most, is_behind

AHEAD_ONLY_WAIT_S: Final = 0.02
"""How long a consumer that holds all the backlog's messages it may (ADR-0128) blocks on the
highest priority's list before it looks at every list again: a message of the highest priority
is taken the moment it comes, and a backlog's next message at most this long after one of its
own ended (Redis cannot widen a ``BRPOP`` under way)."""

DEAD_LETTER_SUFFIX: Final = ".dead"
"""A queue's dead letters are the list named after it with this suffix: next to it in any
listing of keys, and never a queue relayr consumes (``RELAYR_QUEUE`` names its queue)."""


# kombu's annotations are partial: its classes and functions are used untyped, as Any
KombuQoS: Any = kombu_redis.QoS
KombuChannel: Any = kombu_redis.Channel
KombuTransport: Any = kombu_redis.Transport
bytes_to_str: Any = encoding.bytes_to_str
dumps: Any = json.dumps


def dead_letter_list(queue: str) -> str:
    return queue + DEAD_LETTER_SUFFIX


class QoS(KombuQoS):  # type: ignore[misc]  # kombu, used untyped
    """kombu's Redis QoS; a message rejected without requeue is set aside, not dropped. It
    counts the messages of a lower priority it holds (:mod:`relayr.broker.reserve`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.behind: set[str] = set()
        """The delivery tags of the messages of a lower priority held unacknowledged."""

    def append(self, message: Any, delivery_tag: str) -> None:
        super().append(message, delivery_tag)
        if is_behind(message.properties):
            self.behind.add(delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        self.channel.consumed_from.pop(delivery_tag, None)
        self.behind.discard(delivery_tag)
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        self.behind.discard(delivery_tag)
        queue = self.channel.consumed_from.pop(delivery_tag, None)
        if not requeue:
            try:
                message = self.get(delivery_tag)
            except KeyError:
                message = None
            if message is not None:
                if queue is None:  # not delivered through this channel's consume or get
                    queue = (message.delivery_info or {}).get("routing_key") or ""
                self.channel.push_dead_letter(
                    queue, dumps(message.serializable()), "rejected by its consumer"
                )
        super().reject(delivery_tag, requeue=requeue)


class Channel(SetAsideOnError, KombuChannel):  # type: ignore[misc]  # kombu, used untyped
    """kombu's Redis channel whose ``BRPOP`` replies are screened (see the module docstring).

    With the transport option ``behind_at_most`` (:mod:`relayr.broker.reserve`), a consumer that
    holds that many messages of a lower priority asks only the highest priority's list, for
    :data:`AHEAD_ONLY_WAIT_S` at a time, until one of them is settled.
    """

    QoS = QoS
    from_transport_options = (*KombuChannel.from_transport_options, BEHIND_AT_MOST)
    behind_at_most: int | None = None
    priority_steps: list[int]  # kombu's, from its class or its transport option

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._screened: list[tuple[str, bytes, str]] = []
        self.consumed_from: dict[str, str] = {}
        """The queue each unacknowledged delivery came from, by delivery tag: its dead letters'
        list, whatever routing key the message was published with."""
        super().__init__(*args, **kwargs)
        self.behind_at_most = behind_at_most({BEHIND_AT_MOST: self.behind_at_most})

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        def remembered(message: Any) -> Any:
            if not no_ack:
                self.consumed_from[message.delivery_tag] = queue
            return callback(message)

        return super().basic_consume(queue, no_ack, remembered, consumer_tag, **kwargs)

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack=no_ack, **kwargs)
        if message is not None and not no_ack:
            self.consumed_from[message.delivery_tag] = queue
        return message

    def close(self) -> None:
        super().close()  # kombu's QoS gives back what is unacknowledged
        self.consumed_from.clear()
        if self._qos is not None:
            self._qos.behind.clear()

    def _brpop_start(self, timeout: float | None = None) -> Any:
        if not self._ahead_only():
            return super()._brpop_start(timeout)
        with self._highest_priority_only():
            return super()._brpop_start(AHEAD_ONLY_WAIT_S)

    def _get(self, queue: str) -> Any:
        if not self._ahead_only():
            return super()._get(queue)
        with self._highest_priority_only():
            return super()._get(queue)

    def _ahead_only(self) -> bool:
        """Whether this consumer holds all the messages of a lower priority it may."""
        return self.behind_at_most is not None and len(self.qos.behind) >= self.behind_at_most

    @contextmanager
    def _highest_priority_only(self) -> Iterator[None]:
        """kombu's reads for the block name only the highest priority's list of a queue."""
        steps = self.priority_steps
        self.priority_steps = steps[:1]
        try:
            yield
        finally:
            self.priority_steps = steps

    def _create_client(self, asynchronous: bool = False) -> Any:
        client = super()._create_client(asynchronous)
        if asynchronous:  # the client kombu sends BRPOP on
            client.set_response_callback("BRPOP", self._screen_brpop)
        return client

    def _screen_brpop(self, response: Any, **options: Any) -> tuple[Any, Any] | None:
        """redis-py's callback for a ``BRPOP`` reply: the reply, or None (no message) for an
        entry that is not a kombu message, kept to be set aside once the read is over."""
        if not response:
            return None
        key, item = response
        _, problem = decode(item if isinstance(item, bytes) else str(item).encode(), self)
        if problem is None:
            return (key, item)
        queue = bytes_to_str(key).rsplit(self.sep, 1)[0]
        self._screened.append((queue, item, problem))
        return None

    def _brpop_read(self, **options: Any) -> Any:
        try:
            return super()._brpop_read(**options)
        finally:
            while self._screened:
                queue, item, problem = self._screened.pop(0)
                self.push_dead_letter(queue, item, problem)

    def push_dead_letter(self, queue: str, entry: bytes | str, problem: str) -> None:
        """Push ``entry`` onto ``queue``'s dead letters, with its one log line."""
        target = dead_letter_list(queue)
        try:
            with self.conn_or_acquire() as client:
                client.lpush(target, entry)
        except Exception as error:  # the line still names the entry's problem, and this one
            problem = f"{problem}; pushing it onto {target} failed, so it was dropped: {error}"
        log_set_aside(f"redis list {target}", queue, problem)

    def set_aside(self, message: Any, queue: str, problem: str) -> None:
        """Dead-letter a delivered message its consumer raised on (see ``SetAsideOnError``)."""
        if message.acknowledged:
            log_set_aside("", queue, problem)
            return
        self.push_dead_letter(queue, dumps(message.serializable()), problem)
        self.qos.ack(message.delivery_tag)


class Transport(KombuTransport):  # type: ignore[misc]  # kombu, used untyped
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel
