"""kombu's Redis transport, with a consumer that sets aside an entry it cannot use (ADR-0013).

The channel's ``BRPOP`` replies are screened (redis-py's response callback) before kombu decodes
them: an entry that is not a kombu message, or that the consumer raised on or rejected, is pushed
onto ``<queue>.dead`` with one ``broker message set aside`` log line, and the consumer goes on.
Fanout messages and ``rediss://`` keep kombu's own handling.
"""

from typing import Any, Final

from kombu.transport import redis as kombu_redis
from kombu.utils import encoding, json

from relayr.broker.dead_letters import SetAsideOnError, decode, log_set_aside

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
    """kombu's Redis QoS; a message rejected without requeue is set aside, not dropped."""

    def ack(self, delivery_tag: str) -> None:
        self.channel.consumed_from.pop(delivery_tag, None)
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
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
    """kombu's Redis channel whose ``BRPOP`` replies are screened (see the module docstring)."""

    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._screened: list[tuple[str, bytes, str]] = []
        self.consumed_from: dict[str, str] = {}
        """The queue each unacknowledged delivery came from, by delivery tag: its dead letters'
        list, whatever routing key the message was published with."""
        super().__init__(*args, **kwargs)

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
