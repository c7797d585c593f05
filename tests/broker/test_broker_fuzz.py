"""The embedded broker under load, in separate processes, with consumers SIGKILLed mid-batch.

Four producer processes publish :data:`MESSAGES` messages at full speed while two consumer
processes take them (:mod:`tests.broker.broker_agents`). Each consumer incarnation SIGKILLs itself
when it has taken its :data:`KILL_AFTER` count of messages, while it holds up to a prefetch
of them unacknowledged, and the test starts the next incarnation of that consumer at once: the
kills happen at known points of the load, not on a timer. At the end:

- every message was acknowledged, exactly once;
- none was ever read in part: every body a consumer took is the one its producer wrote, and
  nothing was set aside as undecodable;
- a message was taken more than once only if a killed consumer held it unacknowledged: the
  incarnation that acknowledged it took it once, every other take was by a killed one
  (:func:`explained`).

The figures (messages/s, kills, duplicates) are printed as one JSON line.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pytest

from relayr.broker import layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPO: Final = Path(__file__).resolve().parents[2]
MESSAGES: Final = 20_000
PRODUCERS: Final = 4
CONSUMERS: Final = 2
KILL_AFTER: Final = ((900, 1300, 1700), (1100, 1500, 1900))
"""Per consumer, how many messages each incarnation takes before it kills itself; the last
incarnation runs to the end. Each consumer takes thousands, so every kill happens."""

DEADLINE_S: Final = 150.0
"""How long the whole load may take: far above the ~20 s it needs on a 2-core machine."""

QUEUE: Final = "relayr.fuzz"
SEED: Final = 20_251_130


@dataclass
class Incarnation:
    slot: int
    number: int
    kill_after: int
    log: Path
    process: subprocess.Popen[bytes]


@dataclass
class Taken:
    """What the consumers' logs say about one message."""

    takes: list[tuple[int, int]] = field(default_factory=list)  # (slot, incarnation)
    acks: list[tuple[int, int]] = field(default_factory=list)


def agent(
    *args: object, stdout: int | None = None, stderr: int | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.broker.broker_agents", *map(str, args)],
        cwd=REPO,
        stdout=stdout,
        stderr=stderr,
    )


def read_logs(incarnations: list[Incarnation]) -> tuple[dict[str, Taken], list[str]]:
    messages: dict[str, Taken] = defaultdict(Taken)
    bad: list[str] = []
    for each in incarnations:
        if not each.log.exists():
            continue
        for line in each.log.read_text().splitlines():
            kind, *words = line.split()
            where = (each.slot, each.number)
            if kind == "T":
                messages[words[0]].takes.append(where)
                if words[1] != "ok":
                    bad.append(line)
            elif kind == "A":
                for ident in words:
                    messages[ident].acks.append(where)
    return messages, bad


def explained(taken: Taken, killed: set[tuple[int, int]]) -> bool:
    """Whether a message's takes are what kills explain: the incarnation that acknowledged it
    took it once, and every other take was by a killed incarnation that never acknowledged it.
    A message delivered twice to one live consumer is not explained."""
    acker = taken.acks[0]
    others = [where for where in taken.takes if where != acker]
    return taken.takes.count(acker) == 1 and all(
        where in killed and where not in taken.acks for where in others
    )


@pytest.mark.parametrize(
    ("takes", "acks", "ok"),
    [
        ([(0, 0)], [(0, 0)], True),
        ([(0, 0), (1, 0)], [(1, 0)], True),  # taken by a killed incarnation first
        ([(1, 0), (1, 0)], [(1, 0)], False),  # twice to the one that acknowledged it
        ([(1, 1), (1, 0)], [(1, 0)], False),  # another live incarnation took it too
        ([(0, 0), (1, 0)], [(1, 0), (0, 0)], False),  # the killed one acknowledged it as well
    ],
)
def test_only_kills_explain_a_message_taken_again(
    takes: list[tuple[int, int]], acks: list[tuple[int, int]], ok: bool
) -> None:
    assert explained(Taken(takes, acks), killed={(0, 0)}) is ok


@pytest.mark.process
def test_many_producers_and_killed_consumers_lose_nothing_and_read_nothing_half(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "broker"
    stop_file = tmp_path / "stop"
    per_producer = MESSAGES // PRODUCERS
    expected = {f"{p}-{n}" for p in range(PRODUCERS) for n in range(per_producer)}
    incarnations: list[Incarnation] = []
    current: dict[int, Incarnation] = {}
    kills = 0
    consumer_errors = tmp_path / "consumers.err"

    def start(slot: int, number: int) -> None:
        schedule = KILL_AFTER[slot]
        kill_after = schedule[number] if number < len(schedule) else 0
        log = tmp_path / f"consumer-{slot}-{number}.log"
        with consumer_errors.open("ab") as errors:
            process = agent(
                "consume", folder, QUEUE, log, kill_after, stop_file, stdout=errors, stderr=errors
            )
        incarnation = Incarnation(slot, number, kill_after, log, process)
        incarnations.append(incarnation)
        current[slot] = incarnation

    started = time.monotonic()
    for slot in range(CONSUMERS):
        start(slot, 0)
    producers = [
        agent("produce", folder, QUEUE, p, per_producer, SEED, stdout=subprocess.PIPE)
        for p in range(PRODUCERS)
    ]
    try:
        published: list[dict[str, float]] = []
        acked: set[str] = set()
        while True:
            assert time.monotonic() - started < DEADLINE_S, "the load did not end in time"
            for slot, incarnation in list(current.items()):
                code = incarnation.process.poll()
                if code is None:
                    continue
                assert code == -signal.SIGKILL, f"consumer {slot} exited {code}"
                assert incarnation.kill_after, "a consumer died without being told to"
                kills += 1
                start(slot, incarnation.number + 1)
            if len(published) < PRODUCERS and all(p.poll() is not None for p in producers):
                for producer in producers:
                    out, _ = producer.communicate()
                    assert producer.returncode == 0
                    published.append(json.loads(out))
            if len(published) == PRODUCERS:
                messages, _ = read_logs(incarnations)
                acked = {ident for ident, taken in messages.items() if taken.acks}
                if acked >= expected:
                    break
            time.sleep(0.2)
        consumed_s = time.monotonic() - started
        stop_file.touch()
        for incarnation in current.values():
            assert incarnation.process.wait(60) == 0
    finally:
        for process in [*producers, *(i.process for i in incarnations)]:
            if process.poll() is None:
                process.kill()
                process.wait()

    messages, bad = read_logs(incarnations)
    killed = {(i.slot, i.number) for i in incarnations if i.kill_after}
    duplicates = {ident: taken for ident, taken in messages.items() if len(taken.takes) > 1}
    unexplained = {
        ident: taken
        for ident, taken in messages.items()
        if taken.acks and not explained(taken, killed)
    }
    set_aside = [str(path) for path in (folder / layout.DEAD).rglob("*") if path.is_file()]
    figures = {
        "bench": "broker_fuzz",
        "messages": MESSAGES,
        "producers": PRODUCERS,
        "consumers": CONSUMERS,
        "kills": kills,
        "takes": sum(len(t.takes) for t in messages.values()),
        "duplicates": len(duplicates),
        "publish_per_s": round(MESSAGES / max(p["seconds"] for p in published)),
        "end_to_end_per_s": round(MESSAGES / consumed_s),
        "seconds": round(consumed_s, 1),
        "load_avg": [round(load, 2) for load in os.getloadavg()],
    }
    print(json.dumps(figures))
    assert bad == [], bad[:5]
    assert set_aside == [], set_aside[:5]
    assert set(messages) == expected, sorted(set(messages) ^ expected)[:5]
    assert all(len(taken.acks) == 1 for taken in messages.values()), "acknowledged twice"
    assert unexplained == {}, list(unexplained.items())[:5]
    assert kills == sum(len(schedule) for schedule in KILL_AFTER)
    assert layout.count_messages(layout.queue_path(folder, QUEUE)) == 0
    assert not any((folder / layout.CONSUMERS).iterdir())
    assert (consumer_errors.read_text() if consumer_errors.exists() else "").count("Traceback") == 0
