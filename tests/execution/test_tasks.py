"""The Celery shell without a broker: argument checks, the app's settings, the loop thread.

What needs a real worker (delivery, redelivery, shutdown) is in test_worker_integration.py.
"""

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
import structlog
from celery.exceptions import SoftTimeLimitExceeded
from structlog.testing import capture_logs

from relayr.core.errors import InvalidTask
from relayr.core.run_messages import MAX_BATCH_RUNS, RunMessage
from relayr.execution.attempts import RunOutcome
from relayr.execution.executor import Executed
from relayr.observe.logging import configure_logging
from relayr.settings import Settings
from tasks.app import celery_config, create_celery, transport_options
from tasks.runs import (
    LEGACY_TASK_NAME,
    MAX_ID_LENGTH,
    RUN_OUTCOME_LINES,
    TASK_NAME,
    RunIds,
    log_outcome,
    parse_batch,
    parse_ids,
)
from tasks.worker import EventLoopThread


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path)


# ─── arguments ────────────────────────────────────────────────────────────────


def test_ids_by_position_or_by_name() -> None:
    expected = RunIds("acme", "ops", "fir_0123456789abcdef")
    assert parse_ids(("acme", "ops", "fir_0123456789abcdef"), {}) == expected
    assert parse_ids((), {"tenant_id": "acme", "workspace_id": "ops", "run_id": expected.run_id})
    assert parse_ids(("acme",), {"workspace_id": "ops", "run_id": expected.run_id}) == expected


@pytest.mark.parametrize(
    ("args", "kwargs", "problem"),
    [
        ((), {}, "tenant_id is missing"),
        (("a", "b"), {}, "run_id is missing"),
        (("a", "b", "c", "d"), {}, "expected 3 task arguments, got 4"),
        (("a", "b", "c"), {"payload": "x"}, "unexpected task arguments: payload"),
        ((1, "b", "c"), {}, "tenant_id must be a string, not int"),
        (("a", None, "c"), {}, "workspace_id must be a string, not NoneType"),
        (("a", "b", {"id": 1}), {}, "run_id must be a string, not dict"),
        (("a", "", "c"), {}, "workspace_id is empty"),
        (("a", "b", "  "), {}, "run_id is empty"),
        (("a", "b", "x" * (MAX_ID_LENGTH + 1)), {}, "run_id is longer than 256 characters"),
        (("a\x00", "b", "c"), {}, "tenant_id contains a NUL character"),
        (("a", "b", "fir_\ud800"), {}, "run_id is not text that storage can hold"),
        (("a", "b"), {"tenant_id": "evil", "run_id": "c"}, "tenant_id is given twice"),
    ],
)
def test_anything_but_three_ids_is_refused(
    args: tuple[Any, ...], kwargs: dict[str, Any], problem: str
) -> None:
    with pytest.raises(InvalidTask, match=problem) as refused:
        parse_ids(args, kwargs)
    assert refused.value.code == "invalid_task"


@pytest.mark.parametrize(
    ("args", "kwargs", "problem"),
    [
        (("acme", None, ["fir_1"]), {}, "workspace_id must be a string, not NoneType"),
        (("acme", "ops", "fir_1"), {}, "run_ids must be a list of ids, not str"),
        (("acme", "ops", []), {}, "run_ids names no run"),
        (("acme", "ops", ["fir_1", 2]), {}, "run_ids[1] must be a string, not int"),
        (("acme", "ops", ["fir_1", " "]), {}, "run_ids[1] is empty"),
        (
            ("acme", "ops", ["fir_1"] * (MAX_BATCH_RUNS + 1)),
            {},
            f"run_ids names more than {MAX_BATCH_RUNS} runs",
        ),
        (("acme", "ops"), {}, "task argument run_ids is missing"),
        (("acme", "ops", ["fir_1"]), {"run_ids": ["fir_2"]}, "run_ids is given twice"),
    ],
)
def test_anything_but_a_batch_of_ids_is_refused(
    args: tuple[Any, ...], kwargs: dict[str, Any], problem: str
) -> None:
    """The run task's arguments, read as the task reads them. What a worker does with a
    refused message (one line, not requeued) is checked on a real worker in
    test_hostile_messages.py."""
    with pytest.raises(InvalidTask) as refused:
        parse_batch(args, kwargs)
    assert problem in refused.value.message
    assert refused.value.code == "invalid_task"


def test_a_batch_by_position_or_by_name() -> None:
    expected = RunMessage(tenant_id="acme", workspace_id="ops", run_ids=("fir_1", "fir_2"))
    assert parse_batch(("acme", "ops", ["fir_1", "fir_2"]), {}) == expected
    by_name = {"tenant_id": "acme", "workspace_id": "ops", "run_ids": ["fir_1", "fir_2"]}
    assert parse_batch((), by_name) == expected


# ─── outcomes ─────────────────────────────────────────────────────────────────


def test_every_outcome_of_the_executor_has_a_line() -> None:
    outcomes = set(get_args(RunOutcome.__value__))
    assert len(outcomes) == 11
    assert set(RUN_OUTCOME_LINES) == outcomes
    assert RUN_OUTCOME_LINES["not_due"] == (logging.INFO, "run not due: nothing to do")
    assert RUN_OUTCOME_LINES["contended"] == (
        logging.INFO,
        "run held by another worker: nothing to do",
    )


def test_an_outcome_is_logged_with_its_run_fields() -> None:
    with capture_logs() as logs:
        log_outcome(Executed("contended", None, "run fir_1 is held by another executor"))
    assert logs == [
        {
            "event": "run held by another worker: nothing to do",
            "log_level": "info",
            "outcome": "contended",
            "detail": "run fir_1 is held by another executor",
        }
    ]


# ─── the app ──────────────────────────────────────────────────────────────────


def test_the_app_carries_json_only_acks_late_and_reserves_one_message(
    settings: Settings,
) -> None:
    config = celery_config(settings)
    assert config["accept_content"] == ["json"]
    assert config["task_serializer"] == config["result_serializer"] == "json"
    assert config["event_serializer"] == "json"
    assert config["task_acks_late"] is True
    assert config["task_reject_on_worker_lost"] is True
    assert config["task_retry_on_worker_lost"] is True
    assert config["worker_prefetch_multiplier"] == 1
    assert config["task_ignore_result"] is True
    assert config["worker_send_task_events"] is True
    assert config["task_send_sent_event"] is True
    assert config["worker_cancel_long_running_tasks_on_connection_loss"] is True
    assert config["worker_soft_shutdown_timeout"] > 0


def test_time_limits_stay_below_the_visibility_timeout_on_redis(tmp_path: Path) -> None:
    settings = Settings(
        home=tmp_path,
        broker_url="redis://127.0.0.1:6379/0",
        soft_time_limit_s=50,
        time_limit_s=60,
        visibility_timeout_s=90,
    )
    config = celery_config(settings)
    assert (
        config["task_soft_time_limit"]
        < config["task_time_limit"]
        < config["broker_transport_options"]["visibility_timeout"]
    )


def test_the_bounded_redelivery_reaches_the_task_body(settings: Settings) -> None:
    annotations = celery_config(settings)["task_annotations"][TASK_NAME]
    # one more retry than allowed: the task body sees the delivery past the bound
    assert annotations["max_retries"] == settings.max_redeliveries + 1
    # and it arrives after the lost attempt's lease lapsed
    assert annotations["default_retry_delay"] > settings.lease_ttl_s


def test_the_tasks_have_stable_names_and_go_to_the_settings_queue(tmp_path: Path) -> None:
    app = create_celery(Settings(home=tmp_path, queue="runs.eu"))
    assert (TASK_NAME, LEGACY_TASK_NAME) == ("relayr.execute_runs", "relayr.execute_run")
    assert app.conf.task_default_queue == "runs.eu"
    for name in (TASK_NAME, LEGACY_TASK_NAME):
        assert name in app.tasks
        assert app.amqp.router.route({}, name)["queue"].name == "runs.eu"


def test_the_embedded_broker_is_relayr_s_transport_in_a_folder_of_its_home(
    settings: Settings,
) -> None:
    config = celery_config(settings)
    assert config["broker_transport"] == "relayr.broker.filesystem:Transport"
    assert Path(transport_options(settings)["folder"]).is_relative_to(settings.home.absolute())


# ─── the loop thread ──────────────────────────────────────────────────────────


@pytest.fixture
def loop_thread() -> Iterator[EventLoopThread]:
    thread = EventLoopThread()
    thread.start()
    yield thread
    thread.stop()


def test_every_call_runs_on_the_same_loop_in_another_thread(loop_thread: EventLoopThread) -> None:
    async def where() -> tuple[asyncio.AbstractEventLoop, str]:
        return asyncio.get_running_loop(), threading.current_thread().name

    first, second = loop_thread.call(where()), loop_thread.call(where())
    assert first == second == (loop_thread.loop, "relayr-loop")


def test_a_loop_bound_object_survives_from_one_call_to_the_next(
    loop_thread: EventLoopThread,
) -> None:
    # what asyncio.run per task breaks: an object tied to the loop that made it
    async def make() -> asyncio.Queue[int]:
        return asyncio.Queue()

    queue = loop_thread.call(make())
    loop_thread.call(queue.put(1))
    assert loop_thread.call(queue.get()) == 1


def test_work_started_by_a_call_keeps_running_after_it_returns(
    loop_thread: EventLoopThread,
) -> None:
    release, finished = threading.Event(), threading.Event()

    async def turn() -> None:
        await asyncio.to_thread(release.wait, 5)
        finished.set()

    async def send() -> asyncio.Task[None]:
        return asyncio.create_task(turn())

    loop_thread.call(send())
    assert not finished.is_set()  # the turn waits for the release, however fast the machine
    release.set()
    assert finished.wait(5)


def test_a_soft_time_limit_in_the_main_thread_cancels_the_coroutine(
    loop_thread: EventLoopThread,
) -> None:
    cancelled = threading.Event()

    async def long_run() -> None:
        # the limit's signal is armed once the run runs: the main thread then waits in call()
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def soft_limit(signum: int, frame: object) -> None:
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGALRM, soft_limit)
    started = time.monotonic()
    try:
        with pytest.raises(SoftTimeLimitExceeded):
            loop_thread.call(long_run())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert cancelled.wait(5)
    assert time.monotonic() - started < 5


def test_stopping_cancels_what_still_runs_and_closes_the_loop() -> None:
    thread = EventLoopThread()
    thread.start()
    running, cancelled = threading.Event(), threading.Event()

    async def forever() -> None:
        running.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    thread.submit(forever())
    assert running.wait(5)
    thread.stop()
    assert cancelled.is_set()
    assert not thread.running
    assert thread.loop.is_closed()


# ─── logs ─────────────────────────────────────────────────────────────────────


def test_json_logs_are_one_object_per_line_with_bound_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json
    import sys

    configure_logging("json", stream=sys.stderr)
    try:
        with structlog.contextvars.bound_contextvars(run_id="fir_1", tenant="acme"):
            structlog.get_logger("relayr.test").info("run succeeded", outcome="succeeded")
        logging.getLogger("celery.worker").info("a line of Celery's own")
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    finally:
        configure_logging("console")
    assert lines[0]["event"] == "run succeeded"
    assert (lines[0]["run_id"], lines[0]["tenant"], lines[0]["outcome"]) == (
        "fir_1",
        "acme",
        "succeeded",
    )
    assert lines[0]["level"] == "info"
    assert lines[0]["logger"] == "relayr.test"
    assert lines[1]["event"] == "a line of Celery's own"
    assert lines[1]["logger"] == "celery.worker"
