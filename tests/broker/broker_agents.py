"""Producer and consumer processes for the embedded broker's fuzz and dead-consumer tests.

``python -m tests.broker.broker_agents produce <folder> <queue> <producer> <count> <seed>``
publishes ``count`` messages as fast as it can, then prints one JSON line (how many, in how
long). Each body names its message (``<producer>-<n>``) and carries text of a random length
with its SHA-256, so a consumer can tell a message read whole from one read in part.

``python -m tests.broker.broker_agents hold <folder> <queue> <count> <ready_file>`` takes ``count``
messages without acknowledging them, forks a child that sleeps (as a Celery pool process
would, inheriting the open lock file), writes the child's pid to ``ready_file`` and sleeps: for
a test to SIGKILL it while it holds them.

``python -m tests.broker.broker_agents consume <folder> <queue> <log> <kill_after> <stop_file>``
consumes with a prefetch of :data:`PREFETCH`, acknowledging in batches, and appends to ``log``
one line per message taken (``T <id> ok``, or ``T <id> bad <why>``) and one per batch
acknowledged (``A <id> <id> ...``), each with one ``write``, so a SIGKILL never splits a line.
When it has taken ``kill_after`` messages (0: never) it SIGKILLs itself at once, holding the
batch it has not acknowledged: the kill happens at a known point, not on a timer. It stops when
``stop_file`` exists and its queue gave it nothing for :data:`IDLE_S`.
"""

import hashlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any, Final

from kombu import Connection, Consumer, Producer, Queue

TRANSPORT: Final = "relayr.broker.filesystem:Transport"

PREFETCH: Final = 8
"""How many messages a consumer holds unacknowledged at most: what a kill can leave behind."""

IDLE_S: Final = 0.2

SIZES: Final = (0, 1, 100, 1000, 4000, 20000)
"""Body text lengths drawn from, so some messages span many write calls of a publisher."""


def connection(folder: str) -> Connection:
    return Connection(
        "filesystem://localhost/", transport=TRANSPORT, transport_options={"folder": folder}
    )


def body(producer: int, n: int, rng: random.Random) -> dict[str, Any]:
    data = rng.randbytes(rng.choice(SIZES) // 2).hex()
    return {"id": f"{producer}-{n}", "data": data, "sha": hashlib.sha256(data.encode()).hexdigest()}


def produce(folder: str, queue_name: str, producer: int, count: int, seed: int) -> None:
    rng = random.Random(seed * 1000 + producer)
    queue = Queue(queue_name, routing_key=queue_name)
    bodies = [body(producer, n, rng) for n in range(count)]
    with connection(folder) as conn:
        publisher = Producer(conn.default_channel, serializer="json")
        publisher.declare()
        queue(conn.default_channel).declare()
        started = time.monotonic()
        for each in bodies:
            publisher.publish(each, exchange="", routing_key=queue_name)
        elapsed_s = time.monotonic() - started
    print(json.dumps({"producer": producer, "published": count, "seconds": elapsed_s}))


def problem(payload: Any) -> str | None:
    if not isinstance(payload, dict) or set(payload) != {"id", "data", "sha"}:
        return "not-a-test-body"
    if hashlib.sha256(str(payload["data"]).encode()).hexdigest() != payload["sha"]:
        return "digest-mismatch"
    return None


def consume(folder: str, queue_name: str, log_path: str, kill_after: int, stop_file: str) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    queue = Queue(queue_name, routing_key=queue_name)
    pending: list[Any] = []
    taken = 0

    def write(line: str) -> None:
        os.write(log, (line + "\n").encode())

    def ack_pending() -> None:
        if not pending:
            return
        ids = [message.payload["id"] for message in pending]
        for message in pending:
            message.ack()
        pending.clear()
        write("A " + " ".join(ids))

    def on_message(payload: Any, message: Any) -> None:
        nonlocal taken
        taken += 1
        why = problem(payload)
        ident = payload.get("id", "?") if isinstance(payload, dict) else "?"
        write(f"T {ident} ok" if why is None else f"T {ident} bad {why}")
        pending.append(message)
        if taken == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        if len(pending) >= PREFETCH:
            ack_pending()

    with connection(folder) as conn:
        with Consumer(
            conn, [queue], callbacks=[on_message], accept=["json"], prefetch_count=PREFETCH
        ):
            while True:
                try:
                    conn.drain_events(timeout=IDLE_S)
                except TimeoutError:
                    ack_pending()
                    if Path(stop_file).exists():
                        break
        ack_pending()


def hold(folder: str, queue_name: str, count: int, ready_file: str) -> None:
    queue = Queue(queue_name, routing_key=queue_name)
    with connection(folder) as conn:
        channel = conn.default_channel
        queue(channel).declare()
        held = []
        while len(held) < count:
            message = channel.basic_get(queue_name)
            if message is None:
                time.sleep(0.01)
                continue
            held.append(message)
        child = os.fork()
        if child == 0:
            time.sleep(3600)
            os._exit(0)
        Path(ready_file).write_text(str(child))
        time.sleep(3600)


def main(argv: list[str]) -> None:
    command, *args = argv
    if command == "produce":
        folder, queue, producer, count, seed = args
        produce(folder, queue, int(producer), int(count), int(seed))
    elif command == "hold":
        folder, queue, count, ready_file = args
        hold(folder, queue, int(count), ready_file)
    elif command == "consume":
        folder, queue, log_path, kill_after, stop_file = args
        consume(folder, queue, log_path, int(kill_after), stop_file)
    else:
        raise SystemExit(f"unknown command {command!r}: use produce or consume")


if __name__ == "__main__":
    main(sys.argv[1:])
