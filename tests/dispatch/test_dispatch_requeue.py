"""The dispatcher on real reflexr storage (memory, SQLite, PostgreSQL): a message the broker lost
is sent again, one it still holds never is.

A message is sent again ``requeue_after_s`` after the queue went past it, after an empty queue
still held it, or (when the broker cannot say how deep its queue is) after it was the oldest;
a run of a taken message that is still due is sent again; a message waiting behind others is
never copied; a run the queue refused goes with the next pass. The harness (its queue a list of
messages, its clocks moved by the test) is :mod:`tests.dispatch.dispatch_harness`.
"""

from relayr.core.run_messages import RunMessage
from tests.dispatch.dispatch_harness import REQUEUE_AFTER_S, Harness, Ping


async def test_a_message_the_queue_went_past_is_sent_again_after_requeue_after_s(
    harness: Harness,
) -> None:
    """A worker took a later message, yet this one's run is still due: the broker lost it."""
    await harness.publish(Ping())
    _, [lost] = await harness.dispatch()
    await harness.publish(Ping())
    _, [later] = await harness.dispatch()
    await harness.take([later])

    noticed, _ = await harness.dispatch()
    harness.clock.now += REQUEUE_AFTER_S - 1
    _, early = await harness.dispatch()
    harness.clock.now += 1
    done, late = await harness.dispatch()
    _, after = await harness.dispatch()

    assert noticed.waiting == 1
    assert early == []
    assert late == [lost]
    assert (done.enqueued, done.again) == (1, 1)
    assert after == []


async def test_a_message_waiting_behind_others_is_never_copied(harness: Harness) -> None:
    """However long the queue is, and however long a run waits in it."""
    await harness.publish(*(Ping() for _ in range(30)))
    await harness.dispatch_caught_up()
    first = list(harness.queue[0].run_ids)  # the message a worker takes, below
    harness.depth = len(harness.queue)

    copies = []
    for _ in range(20):
        harness.clock.now += REQUEUE_AFTER_S
        _, again = await harness.dispatch()
        copies += again
    await harness.take(first)
    harness.depth -= 1
    for _ in range(5):
        harness.clock.now += REQUEUE_AFTER_S
        _, again = await harness.dispatch()
        copies += again

    assert copies == []


async def test_the_oldest_message_of_an_empty_queue_is_sent_again(harness: Harness) -> None:
    """Nothing was sent after it, and the broker holds nothing: it is gone."""
    await harness.publish(Ping())
    _, [run_id] = await harness.dispatch()
    harness.depth = 1
    harness.clock.now += REQUEUE_AFTER_S * 5
    _, waiting = await harness.dispatch()
    harness.depth = 0

    _, noticed = await harness.dispatch()
    harness.clock.now += REQUEUE_AFTER_S
    _, late = await harness.dispatch()

    assert waiting == []
    assert noticed == []
    assert late == [run_id]


async def test_without_a_queue_depth_the_oldest_message_is_sent_again(harness: Harness) -> None:
    await harness.publish(Ping())
    _, [run_id] = await harness.dispatch()

    _, noticed = await harness.dispatch()
    harness.clock.now += REQUEUE_AFTER_S - 1
    _, early = await harness.dispatch()
    harness.clock.now += 1
    _, late = await harness.dispatch()

    assert noticed == early == []
    assert late == [run_id]


async def test_a_run_of_a_taken_message_still_due_is_sent_again(harness: Harness) -> None:
    """A worker took the message but did not claim this run (its storage failed)."""
    await harness.publish(*(Ping() for _ in range(5)))
    await harness.dispatch()
    [(first, second), *waiting] = [batch.run_ids for batch in harness.queue]
    harness.depth = len(waiting)
    await harness.take([first])

    _, noticed = await harness.dispatch()
    harness.clock.now += REQUEUE_AFTER_S
    _, late = await harness.dispatch()

    assert noticed == []
    assert late == [second]


async def test_a_run_the_queue_refused_is_enqueued_by_the_next_pass(harness: Harness) -> None:
    await harness.publish(Ping())
    refused: list[str] = []

    async def broken(batch: RunMessage) -> None:
        refused.extend(batch.run_ids)
        raise ConnectionError("broker down")

    failed = await harness.dispatcher.pass_once(broken)
    done, enqueued = await harness.dispatch()

    assert failed.failed == 1
    assert failed.enqueued == 0
    assert enqueued == refused
    assert done.enqueued == 1
