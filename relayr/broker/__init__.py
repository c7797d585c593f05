"""The broker: which kombu transport carries relayr's messages, and how many wait in a queue.

``RELAYR_BROKER_URL`` picks the transport (ADR-0013): ``filesystem://`` (the embedded default) is
relayr's own :mod:`relayr.broker.filesystem`, ``redis://`` is :mod:`relayr.broker.redis`, and
``rediss://`` and ``memory://`` are kombu's own. Only the class is swapped (Celery's
``broker_transport``); URLs, options and folders are the settings' own.
"""

from typing import Any, Final

from relayr.broker import layout
from relayr.settings import Settings

FILESYSTEM_TRANSPORT: Final = "relayr.broker.filesystem:Transport"
REDIS_TRANSPORT: Final = "relayr.broker.redis:Transport"


def transport(settings: Settings) -> str | None:
    """The kombu transport class for the settings' broker, or None for kombu's own."""
    if settings.broker_url.startswith("filesystem://"):
        return FILESYSTEM_TRANSPORT
    if settings.broker_url.startswith("redis://"):
        return REDIS_TRANSPORT
    return None


def url(settings: Settings) -> str:
    """The broker's URL for kombu; the embedded one gets a host name, or kombu warns on every
    connection that it has none (the transport ignores it)."""
    if settings.broker_url == "filesystem://":
        return "filesystem://localhost/"
    return settings.broker_url


def transport_options(settings: Settings) -> dict[str, Any]:
    """kombu's transport options for the settings' broker."""
    return settings.broker_transport_options()


def queue_depth(settings: Settings, queue: str | None = None) -> int:
    """How many messages wait in ``queue`` (default: the settings' own), not counting those a
    consumer has taken and not yet acknowledged. 0 for a queue that does not exist.

    The embedded broker's is one listing of the queue's folder; a Redis queue's is kombu's
    passive ``queue_declare`` (one connection, ``EXISTS`` and ``LLEN``).

    Raises:
        ValueError: For ``memory://``, whose queues live inside one process.
        kombu's connection errors: When the broker cannot be reached.
    """
    name = queue or settings.queue
    if settings.broker_url.startswith("filesystem://"):
        return layout.count_messages(layout.queue_path(settings.broker_folder, name))
    if settings.broker_url.startswith("memory://"):
        raise ValueError("memory:// keeps its queues inside one process: no depth to read")

    from kombu import connection as kombu_connection
    from kombu.exceptions import ChannelError

    connect: Any = kombu_connection.Connection  # kombu's annotations are partial: used untyped
    with connect(
        url(settings),
        transport=transport(settings),
        transport_options=transport_options(settings),
    ) as connection:
        channel = connection.default_channel
        try:
            return int(channel.queue_declare(queue=name, passive=True).message_count)
        except ChannelError:
            return 0
