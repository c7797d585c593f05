"""What each scenario breaks, and when: while runs are known to be inside their actions.

No fault waits on a timer or on "N runs finished" to strike: on a quiet machine the load would
be over first. Each one asks for holds (:mod:`tests.faults.holds`), publishes the part of the
load whose runs take them, and strikes once runs are held inside their actions, in known pool
processes; then it releases them. Each waits for conditions only (a file, a process, the
store), at a named poll interval, under a generous bound that fails the scenario. Once it
struck, it checks that each run it holds was still held then (:meth:`Holds.check_held`).
"""

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable
from typing import Final

from tests.faults.constants import (
    HOLD_MAX_S,
    POLL_S,
    PROCESS_WAIT_S,
    REFUSAL_WAIT_S,
    RUNS_WAIT_S,
    WORKER_EXIT_S,
)
from tests.faults.holds import AFTER, BEFORE, Held
from tests.faults.load import Fault, Load
from tests.faults.private_redis import PrivateRedis
from tests.faults.processes import alive, children
from tests.faults.relay import log_lines, refused
from tests.workers import READY_TIMEOUT_S, RelayrProcess

FIRST_SHARE: Final = 0.3
"""The part of the load that runs before a one-off fault: the fault strikes mid-load."""

HELD_SHARE: Final = 0.4
"""The part of the load published with a one-off fault's holds: its runs take them."""

QUEUED_SHARE: Final = 0.15
"""The part of the load published while every pool process holds a run, or while the broker
is down: it waits in the queue, or in the store, while the fault strikes."""

WARM_SHUTDOWN_LINE: Final = "worker: Warm shutdown (MainProcess)"
"""What Celery's worker prints when a SIGTERM starts its warm shutdown."""


async def no_fault(load: Load) -> None:
    """Break nothing: for a scenario whose fault is in the load itself (a poison run)."""


async def _until(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(POLL_S)


def _in_pool(worker: RelayrProcess, held: list[Held]) -> list[int]:
    """The worker's pool processes, after checking that each held run is in one of them."""
    pool = children(worker.process.pid)
    for run in held:
        assert run.pid in pool, f"held run {run.run_id} runs in {run.pid}, not in pool {pool}"
    return pool


async def _queue_behind(load: Load) -> None:
    """Publish a part while every pool process holds a run, and wait until the dispatcher
    handed it to the broker: it waits in the queue (the workers reserve no more messages than
    they run) while the fault strikes."""
    await load.publish(QUEUED_SHARE)
    await _until(
        lambda: len(load.handed.runs) >= load.published_runs,
        "every published run handed to the broker",
        RUNS_WAIT_S,
    )


def kill_pool_processes(kills: int, *, seed: int, concurrency: int = 2) -> Fault:
    """SIGKILL a pool process of the first worker ``kills`` times, each while the run it
    executes is held inside its action, before or after its write; Celery forks a replacement
    each time.

    The moments are random but certain: before each kill, the fault waits until a random number
    of the runs published so far ended, asks for a hold at a random point, and publishes the
    next part of the load, a run of which takes it. A run is held, so killed, at most once.
    """

    async def fault(load: Load) -> None:
        rng = random.Random(seed)
        worker = load.workers[0]
        share = 1 / (kills + 2)
        await load.publish(share)
        for index in range(kills):
            await load.wait_finished(rng.randint(0, load.published_runs))
            point = rng.choice((BEFORE, AFTER))
            held = await load.hold_one(f"kill-{index + 1}", share=share, point=point)
            _in_pool(worker, [held])
            os.kill(held.pid, signal.SIGKILL)
            load.holds.check_held([held], "its pool process was killed")
            load.count("kills")
            load.count("kills_while_runs_ran")
            load.count("kills_after_the_write", point == AFTER)
            load.killed[held.run_id] = held.attempt
            load.holds.release(held.run_id)
        load.figures["pool_replaced_in_s"] = await _pool_replaced(worker, concurrency)

    return fault


async def _pool_replaced(worker: RelayrProcess, size: int) -> float:
    """Seconds until the worker has ``size`` live pool processes again."""
    started = time.monotonic()
    await _until(
        lambda: sum(alive(pid) for pid in children(worker.process.pid)) == size,
        f"the worker's pool back to {size} processes",
        PROCESS_WAIT_S,
    )
    return round(time.monotonic() - started, 1)


def kill_worker() -> Fault:
    """SIGKILL the first worker's main process while both its pool processes hold a run (one
    before its write, one after) and more runs wait in the queue; its pool processes die with
    it (Celery sets their parent-death signal), and a new worker finishes the load."""

    async def fault(load: Load) -> None:
        old = load.workers[0]
        await load.publish(FIRST_SHARE)
        await load.wait_published_ended()
        held = await load.hold(
            ("worker-kill-before", BEFORE), ("worker-kill-after", AFTER), share=HELD_SHARE
        )
        _in_pool(old, held)
        await _queue_behind(load)
        load.figures["runs_running_at_kill"] = len({run.pid for run in held})
        os.kill(old.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        load.holds.check_held(held, "their worker was killed")
        load.count("kills")
        await asyncio.to_thread(old.process.wait)
        load.figures["held_attempts"] = await _held_over(load, held)
        load.figures["held_over_in_s"] = round(time.monotonic() - killed, 1)
        await load.start_worker()

    return fault


async def _held_over(load: Load, held: list[Held]) -> list[str]:
    """Wait until each held attempt is over: ``finished`` (its run ended) or ``stopped`` (its
    process died first, so the attempt never completed: the run must succeed in a later one,
    :attr:`Load.killed`). Held runs are released meanwhile. Returns how each one ended."""
    for run in held:
        load.holds.release(run.run_id)
    over: dict[str, str] = {}
    deadline = time.monotonic() + RUNS_WAIT_S
    while len(over) < len(held):
        for run in held:
            if run.run_id in over:
                continue
            if await load.run_ended(run.run_id):
                over[run.run_id] = "finished"
            elif not alive(run.pid):
                over[run.run_id] = "stopped"
                load.killed[run.run_id] = run.attempt
        assert time.monotonic() < deadline, f"held attempts not over: {held}, {over}"
        await asyncio.sleep(POLL_S)
    return sorted(over.values())


def restart_redis(server: PrivateRedis) -> Fault:
    """SIGKILL Redis while both pool processes hold a run and a part published after they
    took their holds is queued in it (no process is free to take it); keep it down until the
    dispatcher failed to hand it a run (a part is published meanwhile) and the held attempts
    are over (finished once released, or stopped by their worker); then start it again on its
    AOF."""

    async def fault(load: Load) -> None:
        await load.publish(FIRST_SHARE)
        await load.wait_published_ended()
        held = await load.hold(("redis-before", BEFORE), ("redis-after", AFTER), share=HELD_SHARE)
        _in_pool(load.workers[0], held)
        await _queue_behind(load)
        load.figures["runs_running_at_kill"] = len(held)
        load.figures["messages_queued_at_kill"] = server.queued(load.settings.queue)
        failures = load.handed.failures
        server.kill()
        killed = time.monotonic()
        load.holds.check_held(held, "Redis was killed")
        load.count("kills")
        await load.publish(QUEUED_SHARE)
        await _until(
            lambda: load.handed.failures > failures,
            "the dispatcher failing to hand a run to the stopped Redis",
            RUNS_WAIT_S,
        )
        load.figures["held_attempts"] = await _held_over(load, held)
        await asyncio.to_thread(server.restart)
        load.figures["redis_down_s"] = round(time.monotonic() - killed, 1)

    return fault


def cut_postgres(database_url: str, *, cuts: int) -> Fault:
    """``pg_terminate_backend`` every connection to the test's database, ``cuts`` times, each
    while a run is held inside its action (before its write, then after, by turns)."""
    database = database_url.rsplit("/", 1)[1]

    async def fault(load: Load) -> None:
        import asyncpg

        from tests.services import ADMIN_DSN

        share = 1 / (cuts + 2)
        await load.publish(share)
        await load.wait_published_ended()
        per_cut = []
        for index in range(cuts):
            point = (BEFORE, AFTER)[index % 2]
            held = await load.hold_one(f"cut-{index + 1}", share=share, point=point)
            connection = await asyncpg.connect(ADMIN_DSN)
            try:
                cut = await connection.fetchval(
                    "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM "
                    "pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()) AS t",
                    database,
                )
            finally:
                await connection.close()
            load.holds.check_held([held], "its database connections were cut")
            load.count("kills")
            load.count("cuts_while_runs_ran")
            per_cut.append(int(cut))
            load.holds.release(held.run_id)
        load.figures["connections_cut"] = per_cut

    return fault


def sweep_with_a_short_visibility_timeout(*, visibility_timeout_s: float) -> Fault:
    """Hold a run until its message has been unacknowledged longer than
    ``visibility_timeout_s``, then start a second worker whose visibility timeout is that
    short, on a queue of its own: at start, its transport puts back every message
    unacknowledged for longer (kombu's ``restore_visible``), the held run's included, at the
    head of the queue, and the first worker is handed a run it is still running. The held run
    is released once the test saw that delivery refused (``contended``): the run is held for
    all of it, however slow the machine (the bounds of the waits fit in the hold's)."""
    longest_s = visibility_timeout_s + READY_TIMEOUT_S + REFUSAL_WAIT_S
    assert longest_s < HOLD_MAX_S, f"the sweep may take {longest_s} s, above the hold's bound"

    async def fault(load: Load) -> None:
        held = await load.hold_one("slow", share=FIRST_SHARE)
        # its message was delivered before it took the hold: older than the timeout after this
        await _until(
            lambda: time.time() > held.at + visibility_timeout_s,
            "the held run's message older than the visibility timeout",
            visibility_timeout_s + PROCESS_WAIT_S,
        )
        load.figures["runs_running_at_sweep"] = sum(
            run.status == "running" for run in await load.runs()
        )
        sweeper = await load.start_worker(
            concurrency=1,
            queue=f"{load.settings.queue}.sweeper",
            visibility_timeout_s=visibility_timeout_s,
            soft_time_limit_s=visibility_timeout_s / 4,
            time_limit_s=visibility_timeout_s / 2,
        )
        load.count("sweeps")
        try:
            await _refused(load, held)
            load.figures["slow_run_refused_again"] = True
        finally:
            load.holds.release(held.run_id)
            load.figures["slow_run_held_s"] = round(time.time() - held.at, 1)
            await asyncio.to_thread(sweeper.stop)

    return fault


async def _refused(load: Load, held: Held) -> None:
    """Wait until a worker logged a delivery of the held run refused as ``contended``, while
    the run was still held.

    Raises:
        AssertionError: If the hold gave up first, or no such delivery came in
            :data:`REFUSAL_WAIT_S`.
    """
    deadline = time.monotonic() + REFUSAL_WAIT_S
    while not any(refused(line, {held.run_id}) for line in log_lines(load.log_dir)):
        load.holds.check_held([held], "the sweep's redelivery was refused")
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no delivery of the held run {held.run_id} was refused within "
                f"{REFUSAL_WAIT_S} s of the sweeping worker's start"
            )
        await asyncio.sleep(POLL_S)
    load.holds.check_held([held], "the sweep's redelivery was refused")


def terminate_worker() -> Fault:
    """SIGTERM the first worker (a warm shutdown) while both its pool processes hold a run (one
    before its write, one after) and more runs wait in the queue; once its shutdown began,
    release them: both attempts must finish. Then start a new worker to finish the load."""

    async def fault(load: Load) -> None:
        old = load.workers[0]
        await load.publish(FIRST_SHARE)
        await load.wait_published_ended()
        held = await load.hold(
            ("sigterm-before", BEFORE), ("sigterm-after", AFTER), share=HELD_SHARE
        )
        _in_pool(old, held)
        await _queue_behind(load)
        load.attempts_at_fault = {run.run_id: run.epoch for run in held}
        load.figures["runs_running_at_sigterm"] = len(held)
        old.signal(signal.SIGTERM)
        sent = time.monotonic()
        await _until(
            lambda: WARM_SHUTDOWN_LINE in old.log(), "the warm shutdown begun", PROCESS_WAIT_S
        )
        load.holds.check_held(held, "the warm shutdown began")
        for run in held:
            load.holds.release(run.run_id)
        load.figures["exit_code"] = await asyncio.to_thread(old.wait, WORKER_EXIT_S)
        load.figures["stopped_in_s"] = round(time.monotonic() - sent, 1)
        load.count("kills")
        await load.start_worker()

    return fault
