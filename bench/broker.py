"""The embedded broker alone: messages/s published and consumed, kombu's transport beside relayr's.

``python -m bench.broker --n 5000`` publishes N messages the size of a run task's into an
empty queue, one process, as fast as it can, then consumes them with a prefetch of one and an
acknowledgement each (as a worker process with ``worker_prefetch_multiplier=1`` does), for:

- ``kombu-filesystem``: kombu's filesystem transport as relayr configured it before ADR-0013
  (one folder in and out, polled every 50 ms);
- ``relayr-filesystem``: relayr's transport (:mod:`relayr.broker.filesystem`), the default;
- ``relayr-filesystem-fsync``: the same with ``fsync`` on (each message flushed to disk).

Each transport gets a fresh folder under ``.relayr/bench`` per round; the transports take
turns, ``--rounds`` times (3), and each one's figures are the medians of its rounds, so a
moment when the disk is busy (a shared host's other processes) weighs on every transport
alike. One JSON line per transport on stdout, with every round's figures, the machine and its
load average: run it on a quiet machine, one benchmark at a time.
"""

import argparse
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from kombu import Connection, Consumer, Producer, Queue

from bench.common import emit, fresh_home, machine, note

QUEUE: Final = "relayr.bench.broker"
BODY: Final = {
    "runs": [["tenant-0001", "workspace-0001", "fir_0123456789abcdef"]],
    "padding": "x" * 200,
}
"""About the size of a run task's body; Celery's headers make a message ~1.5 KiB on disk."""


def kombu_filesystem(folder: Path) -> Connection:
    folders = {name: folder / name for name in ("queue", "processed", "control")}
    for each in folders.values():
        each.mkdir(parents=True, exist_ok=True)
    return Connection(
        "filesystem://localhost/",
        transport_options={
            "data_folder_in": str(folders["queue"]),
            "data_folder_out": str(folders["queue"]),
            "processed_folder": str(folders["processed"]),
            "control_folder": str(folders["control"]),
            "polling_interval": 0.05,
        },
    )


def relayr_filesystem(*, fsync: bool) -> Callable[[Path], Connection]:
    def connect(folder: Path) -> Connection:
        return Connection(
            "filesystem://localhost/",
            transport="relayr.broker.filesystem:Transport",
            transport_options={"folder": str(folder), "fsync": fsync},
        )

    return connect


TRANSPORTS: Final[dict[str, Callable[[Path], Connection]]] = {
    "kombu-filesystem": kombu_filesystem,
    "relayr-filesystem": relayr_filesystem(fsync=False),
    "relayr-filesystem-fsync": relayr_filesystem(fsync=True),
}


def measure(name: str, connect: Callable[[Path], Connection], n: int) -> dict[str, Any]:
    folder = fresh_home(f"broker-{name}")
    queue = Queue(QUEUE, routing_key=QUEUE)
    try:
        with connect(folder) as connection:
            queue(connection.default_channel).declare()
            producer = Producer(connection.default_channel, serializer="json")
            started = time.perf_counter()
            for _ in range(n):
                producer.publish(BODY, exchange="", routing_key=QUEUE)
            published_s = time.perf_counter() - started

            consumed = 0

            def on_message(body: Any, message: Any) -> None:
                nonlocal consumed
                consumed += 1
                message.ack()

            with Consumer(
                connection, [queue], callbacks=[on_message], accept=["json"], prefetch_count=1
            ):
                started = time.perf_counter()
                while consumed < n:
                    try:
                        connection.drain_events(timeout=5)
                    except TimeoutError:
                        break
                consumed_s = time.perf_counter() - started
        return {
            "consumed": consumed,
            "publish_per_s": round(n / published_s),
            "consume_per_s": round(consumed / consumed_s),
            "publish_us": round(published_s / n * 1e6, 1),
            "consume_us": round(consumed_s / max(consumed, 1) * 1e6, 1),
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.broker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--n", type=int, default=5000, help="messages per transport")
    parser.add_argument(
        "--transports", nargs="+", choices=sorted(TRANSPORTS), default=list(TRANSPORTS)
    )
    parser.add_argument("--rounds", type=int, default=3, help="turns each transport takes")
    args = parser.parse_args(argv)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in args.transports}
    for number in range(1, args.rounds + 1):
        for name in args.transports:
            note(f"round {number}: {name}: publishing and consuming {args.n} messages")
            rounds[name].append(measure(name, TRANSPORTS[name], args.n))
    for name, measured in rounds.items():
        emit(
            {
                "bench": "broker",
                "transport": name,
                "n": args.n,
                "rounds": len(measured),
                "consumed": min(each["consumed"] for each in measured),
                **{
                    key: round(statistics.median(each[key] for each in measured), 1)
                    for key in ("publish_per_s", "consume_per_s", "publish_us", "consume_us")
                },
                "each_round": [
                    {key: each[key] for key in ("publish_per_s", "consume_per_s")}
                    for each in measured
                ],
                "machine": machine(),
            }
        )


if __name__ == "__main__":
    main()
