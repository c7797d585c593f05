"""The embedded broker delivers: published whole, taken in order, kept until settled.

On real files through kombu's own API (ADR-0013): a message is published whole, taken in enqueue
order, deleted once acknowledged, put back first and marked redelivered on requeue, set aside
with one log line when rejected, and given back when its channel closes.
"""

import json
import os
from pathlib import Path

from kombu import Connection, Producer, Queue
from structlog.testing import capture_logs

from relayr.broker import layout, queue_depth
from relayr.broker.dead_letters import SET_ASIDE
from relayr.settings import Settings
from tasks.runs import BACKLOG_PRIORITY
from tests.broker.broker_files import QUEUE, connect, held, publish, set_aside, take, waiting


def test_a_published_message_is_whole_in_its_queue_and_nothing_stays_behind(
    conn: Connection, folder: Path
) -> None:
    publish(conn, {"n": 1})
    (name,) = waiting(folder)
    assert json.loads((layout.queue_path(folder, QUEUE) / name).read_bytes())["body"]
    assert os.listdir(folder / layout.INCOMING) == []
    assert queue_depth(Settings(home=folder.parent), QUEUE) == 1


def test_messages_are_taken_in_enqueue_order_across_listings(conn: Connection) -> None:
    publish(conn, *range(1200))  # more than one listing's candidates
    assert [take(conn).payload for _ in range(1200)] == list(range(1200))
    assert take(conn) is None


def test_a_message_of_the_highest_priority_is_taken_before_lower_ones_sent_earlier(
    conn: Connection, folder: Path
) -> None:
    """Even one that comes after a listing of the lower ones: they are taken from a listing
    made when each is taken (a dispatcher's backlog goes behind, ADR-0114)."""
    producer = Producer(conn.default_channel, serializer="json")
    for body in ("behind-1", "behind-2", "behind-3"):
        producer.publish(body, exchange="", routing_key=QUEUE, priority=BACKLOG_PRIORITY)
    publish(conn, "ahead-1")
    assert take(conn).payload == "ahead-1"
    assert take(conn).payload == "behind-1"
    publish(conn, "ahead-2")

    taken = [take(conn).payload for _ in range(3)]

    assert taken == ["ahead-2", "behind-2", "behind-3"]
    assert take(conn) is None
    assert waiting(folder) == []


def test_ack_deletes_the_taken_message(conn: Connection, folder: Path) -> None:
    publish(conn, "a")
    message = take(conn)
    assert waiting(folder) == []
    assert len(held(folder)) == 1
    message.ack()
    assert held(folder) == []
    assert waiting(folder) == []


def test_requeue_puts_the_message_first_marked_redelivered(conn: Connection, folder: Path) -> None:
    publish(conn, "first", "second")
    first = take(conn)
    assert not first.delivery_info.get("redelivered")
    first.reject(requeue=True)
    again = take(conn)
    assert again.payload == "first"
    assert again.delivery_info["redelivered"] is True
    again.ack()
    assert take(conn).payload == "second"


def test_a_rejected_message_is_set_aside_with_one_line(conn: Connection, folder: Path) -> None:
    publish(conn, "unwanted")
    message = take(conn)
    with capture_logs() as logs:
        message.reject(requeue=False)
    (line,) = [line for line in logs if line["event"] == SET_ASIDE]
    (dead,) = set_aside(folder)
    assert line["path"] == str(dead)
    assert line["problem"] == "rejected by its consumer"
    assert held(folder) == []


def test_closing_the_channel_gives_back_what_it_held(folder: Path) -> None:
    with connect(folder) as first:
        Queue(QUEUE, routing_key=QUEUE)(first.default_channel).declare()
        publish(first, "kept")
        assert take(first).payload == "kept"  # never acknowledged
    assert held(folder) == []
    assert len(waiting(folder)) == 1
    assert os.listdir(folder / layout.CONSUMERS) == []
    with connect(folder) as second:
        message = take(second)
        assert (message.payload, message.delivery_info["redelivered"]) == ("kept", True)


def test_no_ack_consumers_leave_nothing_held(conn: Connection, folder: Path) -> None:
    publish(conn, "once")
    assert conn.default_channel.basic_get(QUEUE, no_ack=True).payload == "once"
    assert held(folder) == []
    assert waiting(folder) == []
