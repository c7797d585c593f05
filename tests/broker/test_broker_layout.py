"""The embedded broker's names: a queue's folder stays in its folder, messages sort in order.

Any queue name gets a folder name of its own that cannot leave the broker's folder, and message
names sort in enqueue order, a redelivered one first (ADR-0013). Pure: names only, no files.
"""

import pytest

from relayr.broker import layout


@pytest.mark.parametrize(
    "queue", ["relayr.runs", "celery@host.celery.pidbox", "a/b", "..", ".hidden", "", "é" * 300]
)
def test_a_queue_folder_name_stays_in_its_folder(queue: str) -> None:
    name = layout.queue_folder_name(queue)
    assert name
    assert "/" not in name
    assert not name.startswith(".")
    assert len(name.encode()) <= 255


def test_distinct_queues_get_distinct_folders() -> None:
    queues = ["a/b", "a%2Fb", "a.b", "x" * 400, "x" * 399 + "y", "%2E", "."]
    assert len({layout.queue_folder_name(q) for q in queues}) == len(queues)


def test_names_sort_in_enqueue_order() -> None:
    names = [layout.message_name(now_ns=t) for t in (5, 10**18, 3 * 10**18)]
    assert sorted(names) == names
    again = layout.redelivered_name(names[0])
    assert sorted([names[1], again]) == [again, names[1]]
    assert layout.is_redelivered(again)
    assert layout.redelivered_name(again) == again
