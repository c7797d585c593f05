"""Holds: a run known to be inside its action, kept there until the test lets it go.

A fault must land while the thing it breaks is happening. A timer cannot promise that: on a
quiet machine the load is over before it fires, on a busy one the fault lands anywhere. So the
test asks for a hold (:meth:`Holds.want`) before it publishes the part of the load that will
take it, and the first run of the fault application that reaches the hold's point takes it: it
announces itself (run id, rule, attempt, epoch, pid) and waits for the test's release. The test
then knows that a run is inside its action in process ``pid``, breaks what it breaks, and
releases the run.

- Two points in an action: :data:`BEFORE` its write (the run claimed, nothing written yet) and
  :data:`AFTER` it (the notice or message committed, the attempt not yet completed: a retry
  must find its write done, not make it twice).
- The folder ``<RELAYR_HOME>/holds`` is the only channel: the workers and the test share the
  home. Files appear whole (written aside, then renamed into place), and a request is taken by
  one action only: taking it is a rename, which succeeds once.
- A run is held at most once, whatever its attempts: a run held and killed is not held (and
  killed) again on its next attempt, so no hold can push a run to the worker-lost bound.
- A process holds at most one run at a time (a message names several runs, whose actions run
  at once in one process): holds asked for together are taken in different processes.
- A held action waits for the test's release, not for a clock. It stops waiting on its own
  only after :data:`~tests.faults.constants.HOLD_MAX_S` (for a test that died), far longer than
  any fault holds a run, and says so (:meth:`Holds.gave_up`); a fault checks, once it struck,
  that none of its holds did (:meth:`Holds.check_held`), and fails naming it otherwise: it
  would have struck a run that went on.
"""

import asyncio
import json
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Literal

from tests.faults.constants import HOLD_MAX_S, HOLD_WAIT_S, POLL_S

type Point = Literal["before", "after"]

BEFORE: Final[Point] = "before"
AFTER: Final[Point] = "after"

HOLDS_FOLDER: Final = "holds"


@dataclass(frozen=True)
class Held:
    """A run that took a hold: it is inside its action, in process ``pid``, until released."""

    label: str
    point: Point
    run_id: str
    rule: str
    attempt: int
    epoch: int
    pid: int
    at: float
    """When it took the hold (``time.time()``); its message was delivered before."""


class Holds:
    """The holds folder of one home, for the test (want, wait, release) and the fault
    application's actions (take, announce, wait for the release)."""

    def __init__(self, home: Path) -> None:
        self.root = home.absolute() / HOLDS_FOLDER
        self._wanted = self.root / "wanted"
        self._taken = self.root / "taken"
        self._held = self.root / "held"
        self._released = self.root / "released"
        self._gave_up = self.root / "gave-up"
        self._aside = self.root / "aside"

    def _folders(self) -> None:
        for folder in (
            self._wanted,
            self._taken,
            self._held,
            self._released,
            self._gave_up,
            self._aside,
        ):
            folder.mkdir(parents=True, exist_ok=True)

    def _write(self, path: Path, text: str) -> None:
        self._folders()
        aside = self._aside / uuid.uuid4().hex
        aside.write_text(text)
        aside.rename(path)

    # ─── the test's side ──────────────────────────────────────────────────────

    def want(self, label: str, point: Point = BEFORE) -> None:
        """Ask for a hold: the next run to reach ``point`` of its action takes it."""
        self._write(self._wanted / label, point)

    async def wait_held(self, label: str, timeout_s: float = HOLD_WAIT_S) -> Held:
        """Wait until a run took the hold ``label``; return it."""
        deadline = time.monotonic() + timeout_s
        while True:
            for held in self.held():
                if held.label == label:
                    return held
            if time.monotonic() > deadline:
                raise AssertionError(f"no run took the hold {label} in {timeout_s} s")
            await asyncio.sleep(POLL_S)

    def held(self) -> list[Held]:
        """Every run that took a hold so far."""
        if not self._held.is_dir():
            return []
        return [Held(**json.loads(path.read_text())) for path in sorted(self._held.iterdir())]

    def release(self, run_id: str) -> None:
        """Let the run held as ``run_id`` go on (a run killed meanwhile never reads it)."""
        self._write(self._released / run_id, "")

    def gave_up(self, run_id: str) -> bool:
        """Whether the held run stopped waiting for its release on its own."""
        return (self._gave_up / run_id).exists()

    def check_held(self, held: Sequence[Held], struck: str) -> None:
        """Check that each of ``held`` was still held when the fault ``struck``.

        Raises:
            AssertionError: Naming a hold that gave up first (its run went on before the
                fault struck).
        """
        for run in held:
            if self.gave_up(run.run_id):
                raise AssertionError(
                    f"hold {run.label} of run {run.run_id} gave up before {struck}: it waited "
                    f"{HOLD_MAX_S} s for a release that did not come"
                )

    def close(self) -> None:
        """Withdraw the requests no run took and release every held run: once a fault is over,
        no run may be held."""
        if not self.root.is_dir():
            return
        for wanted in self._wanted.iterdir():
            wanted.unlink(missing_ok=True)
        for held in self.held():
            if not (self._released / held.run_id).exists():
                self.release(held.run_id)

    # ─── the action's side ────────────────────────────────────────────────────

    async def hold_if_wanted(self, run: Any, rule: str, point: Point) -> None:
        """Take a hold wanted at ``point``, if any and if ``run`` was never held, announce it,
        and wait for the release (at most :data:`~tests.faults.constants.HOLD_MAX_S`)."""
        if not self._wanted.is_dir() or (self._held / f"{run.id}.json").exists():
            return
        pid = os.getpid()
        if any(held.pid == pid and not self._over(held.run_id) for held in self.held()):
            return
        label = self._take(point)
        if label is None:
            return
        held = Held(label, point, run.id, rule, run.attempts, run.epoch, pid, time.time())
        self._write(self._held / f"{run.id}.json", json.dumps(asdict(held)))
        deadline = time.monotonic() + HOLD_MAX_S
        while not (self._released / run.id).exists():
            if time.monotonic() > deadline:
                self._write(self._gave_up / run.id, "")
                return
            await asyncio.sleep(POLL_S)

    def _over(self, run_id: str) -> bool:
        return (self._released / run_id).exists() or (self._gave_up / run_id).exists()

    def _take(self, point: Point) -> str | None:
        for wanted in sorted(self._wanted.iterdir()):
            try:
                if wanted.read_text() != point:
                    continue
                wanted.rename(self._taken / wanted.name)
            except FileNotFoundError:
                continue  # another action took it first
            return wanted.name
        return None
