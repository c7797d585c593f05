"""The dispatcher's fair queue alone: how long handing out a workspace's backlog takes.

``python -m bench.fair_queue`` fills one workspace's lane with N due runs (``--sizes``: 1,000,
5,000 and 20,000) and hands them all out in messages of five, one message at a time, as a
dispatcher does while workers take them (one message of the workspace in the broker at once),
``--rounds`` times (5). One JSON line per size: the median milliseconds for the whole backlog
and per message. A hand-out whose cost grows with what is left behind shows as a time per
message that grows with N; one that does not, as the same time per message at every size.
"""

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Final

from bench.common import emit, machine
from relayr.core.fairness import FairQueue

BATCH: Final = 5
WORKSPACE: Final = ("bench", "flood")


def drain_ms(size: int) -> tuple[float, int]:
    """Hand out a lane of ``size`` runs, a message at a time; its milliseconds, and messages."""
    queue: FairQueue[int] = FairQueue(per_workspace=1, batch=BATCH, spread=1)
    for index in range(size):
        queue.add(WORKSPACE, index, index)
    messages = 0
    started = time.perf_counter()
    while len(queue):
        messages += len(queue.hand_out({}))
    return (time.perf_counter() - started) * 1000.0, messages


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fair_queue", description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 20000])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if min(args.sizes) < 1 or args.rounds < 1:
        parser.error("--sizes and --rounds must be at least 1")
    emit({"bench": "machine", **machine()})
    for size in args.sizes:
        rounds = [drain_ms(size) for _ in range(args.rounds)]
        total = statistics.median(ms for ms, _ in rounds)
        messages = rounds[0][1]
        emit(
            {
                "bench": "fair_queue",
                "runs": size,
                "messages": messages,
                "drain_ms": round(total, 2),
                "per_message_us": round(total * 1000.0 / messages, 2),
            }
        )


if __name__ == "__main__":
    main()
