"""``relayr publish --data-file``: many events in one process, all checked before the first write.

Runs in this process (click's runner) on a home of the test's own, and reads the workspace's
log to count what was written. Files are longer than one transaction's chunk, so a refusal
after the first chunk would show as events written.
"""

import asyncio
import contextlib
import ctypes
import json
import os
import pty
import signal
import sqlite3
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from reflexr import Event, SourceActor

from relayr.cli import cli
from relayr.cli.processes import relayr_command
from relayr.cli.publish import CHUNK_EVENTS
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tests.workers import REPO, relayr_environment

LINES = CHUNK_EVENTS * 2 + 1
"""Three transactions' worth of events."""

STREAM_LINE_S = 120.0
"""How long a ``relayr publish --stream`` process may take to answer a line: its start (the
database's migration) included, on a busy host."""


class Unaccepted(Event, abstract=True, event_namespace="probe"):
    """Events reflexr knows (registered here) that the example application does not accept."""


class Stray(Unaccepted, name="stray"):
    """``probe:stray``: a valid event of a type the application was not given."""

    note: str


@pytest.fixture
def environment(tmp_path: Path) -> dict[str, str]:
    return relayr_environment(tmp_path)


def deploy(index: int, *, typed: bool = False) -> dict[str, Any]:
    data: dict[str, Any] = {"service": f"svc-{index}", "status": "ok", "thread_id": "thr_1"}
    return {"type": "deploy:finished", **data} if typed else data


def write(path: Path, lines: Iterator[object] | list[object]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def publish(environment: dict[str, str], *args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(
        cli, ["publish", "acme/ops", *args], env=environment, input=stdin, catch_exceptions=False
    )


def log(environment: dict[str, str]) -> list[Any]:
    """The workspace's log: every envelope published into acme/ops."""

    async def read() -> list[Any]:
        runtime = await Runtime.start(Settings.from_env(environment), role="cli")
        async with runtime:
            handle = await runtime.application.rules.open(
                "acme", "ops", actor=SourceActor(name="test")
            )
            return list(await handle.read())

    return asyncio.run(read())


def test_a_file_is_published_in_order_in_few_transactions_once(
    environment: dict[str, str], tmp_path: Path
) -> None:
    events = write(tmp_path / "events.jsonl", [deploy(index) for index in range(LINES)])
    args = ["deploy:finished", "--data-file", str(events), "--id-prefix", "import-1", "--json"]
    first = publish(environment, *args)
    assert first.exit_code == 0, first.output
    assert first.stderr == ""  # no progress bar: stderr is not a terminal
    assert json.loads(first.stdout) == {
        "events": LINES,
        "added": LINES,
        "duplicates": 0,
        "first_seq": 1,
        "last_seq": LINES,
        "transactions": 3,
    }
    envelopes = log(environment)
    assert [envelope.data["service"] for envelope in envelopes] == [
        f"svc-{index}" for index in range(LINES)
    ]
    assert [envelope.id for envelope in envelopes] == [
        f"import-1-{number}" for number in range(1, LINES + 1)
    ]
    again = publish(environment, *args)
    assert json.loads(again.stdout)["duplicates"] == LINES
    assert len(log(environment)) == LINES


def test_stdin_lines_name_their_types(environment: dict[str, str]) -> None:
    lines = [
        deploy(1, typed=True),
        {"type": "incident:opened", "title": "checkout errors", "thread_id": "thr_1"},
        deploy(2, typed=True),
    ]
    stdin = "\n".join(json.dumps(line) for line in lines) + "\n\n"  # a blank line is skipped
    result = publish(environment, "--data-file", "-", stdin=stdin)
    assert result.exit_code == 0, result.output
    assert result.stdout == "published 3 event(s) into acme/ops, seq 1-3, in 1 transaction(s)\n"
    assert [envelope.event_type for envelope in log(environment)] == [
        "deploy:finished",
        "incident:opened",
        "deploy:finished",
    ]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must be a JSON object, not list"),
        (json.dumps({"service": "api"}), "invalid deploy:finished event: status: Field required"),
        (json.dumps({**deploy(0), "type": "deploy:finished"}), "must not contain 'type'"),
        (json.dumps({**deploy(0), "service": "a\u0000b"}), "cannot hold a NUL character"),
    ],
    ids=["json", "not an object", "invalid event", "type twice", "nul"],
)
def test_a_bad_line_is_refused_by_its_number_and_nothing_is_published(
    environment: dict[str, str], tmp_path: Path, bad: str, message: str
) -> None:
    number = CHUNK_EVENTS + 100  # past the first transaction's chunk
    lines = [json.dumps(deploy(index)) for index in range(LINES)]
    lines[number - 1] = bad
    events = tmp_path / "events.jsonl"
    events.write_text("\n".join(lines) + "\n")
    result = publish(environment, "deploy:finished", "--data-file", str(events))
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"Error: line {number} of {events}")
    assert message in line
    assert log(environment) == []


def test_a_type_the_application_does_not_accept_is_refused_before_any_write(
    environment: dict[str, str],
) -> None:
    number = CHUNK_EVENTS + 100
    lines: list[dict[str, Any]] = [deploy(index, typed=True) for index in range(LINES)]
    lines[number - 1] = {"type": Stray.event_type, "note": "not the application's"}
    result = publish(environment, "--data-file", "-", stdin="\n".join(map(json.dumps, lines)))
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"Error: line {number}: ")
    assert "probe:stray" in line
    assert line.endswith("nothing was published")
    assert log(environment) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["deploy:finished", "--data", "{}", "--data-file", "-"], "give --data or --data-file"),
        (["deploy:finished", "--data-file", "-", "--id", "e1"], "use --id-prefix"),
        (["deploy:finished", "--id-prefix", "p"], "use --id for one event"),
        (["--data", "{}"], "give EVENT_TYPE"),
        (["deploy:finished", "--data-file", "-", "--id-prefix", "a b"], "--id-prefix 'a b'"),
        (["deploy:finished", "--stream"], "--stream publishes the lines of --data-file"),
    ],
)
def test_options_that_do_not_go_together_are_refused(
    environment: dict[str, str], args: list[str], message: str
) -> None:
    result = publish(environment, *args, stdin=json.dumps(deploy(1)))
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert not Path(environment["RELAYR_HOME"], "relayr.db").exists()


def test_an_empty_file_is_refused(environment: dict[str, str]) -> None:
    result = publish(environment, "deploy:finished", "--data-file", "-", stdin="\n\n")
    assert result.exit_code == 2, result.output
    assert "stdin has no event" in result.stderr


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_a_line_that_is_not_utf8_is_refused_by_its_number_and_nothing_is_published(
    environment: dict[str, str], tmp_path: Path, source: str
) -> None:
    number = CHUNK_EVENTS + 100
    lines = [json.dumps(deploy(index)).encode() for index in range(LINES)]
    lines[number - 1] = lines[number - 1].replace(b"svc-", b"svc-\xff")  # Latin-1, say
    raw = b"\n".join(lines) + b"\n"
    events = tmp_path / "events.jsonl"
    events.write_bytes(raw)
    if source == "file":
        result = publish(environment, "deploy:finished", "--data-file", str(events))
        name = str(events)
    else:
        result = CliRunner().invoke(
            cli,
            ["publish", "acme/ops", "deploy:finished", "--data-file", "-"],
            env=environment,
            input=raw,
            catch_exceptions=False,
        )
        name = "stdin"
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line == f"Error: line {number} of {name} is not UTF-8 text: byte 0xff at column 18"
    assert not Path(environment["RELAYR_HOME"], "relayr.db").exists()


def refuse_events_after(environment: dict[str, str], seq: int) -> None:
    """Make the database refuse every event of acme/ops past ``seq``, as a full disk would: a
    real failure of the write, deterministic, after the first transaction of a file."""
    assert publish(environment, "deploy:finished", "--data", json.dumps(deploy(0))).exit_code == 0
    database = sqlite3.connect(Path(environment["RELAYR_HOME"]) / "relayr.db")
    with database:
        database.execute(
            "CREATE TRIGGER disk_full BEFORE INSERT ON reflexr_events "
            f"WHEN NEW.workspace_id = 'ops' AND NEW.seq > {seq} "
            "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"
        )
    database.close()


@pytest.mark.parametrize(
    ("prefix", "advice"),
    [
        (
            ["--id-prefix", "import-9"],
            "publishing the file again with the same --id-prefix import-9 adds only what is "
            "missing",
        ),
        (
            [],
            f"publish only the lines after line {CHUNK_EVENTS}: without --id-prefix, publishing "
            f"the file again would add the events of lines 1-{CHUNK_EVENTS} a second time",
        ),
    ],
    ids=["with a prefix", "without"],
)
def test_a_file_published_half_way_says_what_is_safe_to_do_next(
    environment: dict[str, str], tmp_path: Path, prefix: list[str], advice: str
) -> None:
    refuse_events_after(environment, 1 + CHUNK_EVENTS)  # the event above, then one chunk
    events = write(tmp_path / "events.jsonl", [deploy(index) for index in range(LINES)])
    result = publish(environment, "deploy:finished", "--data-file", str(events), *prefix)
    assert result.exit_code == 1, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(
        f"Error: published the events of lines 1-{CHUNK_EVENTS} ({CHUNK_EVENTS}), not the rest: "
    )
    assert line.endswith(f"IntegrityError: database or disk is full; {advice}")
    assert len(log(environment)) == 1 + CHUNK_EVENTS


def test_a_stream_publishes_and_prints_each_line_in_a_transaction_of_its_own(
    environment: dict[str, str],
) -> None:
    lines = [json.dumps(deploy(1)), "", json.dumps(deploy(2)), json.dumps(deploy(1))]
    args = ["deploy:finished", "--data-file", "-", "--stream", "--id-prefix", "tail", "--json"]
    result = publish(environment, *args, stdin="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("publishing each line of stdin into acme/ops as it is read")
    printed = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(line["line"], line["seq"], line["duplicate"]) for line in printed] == [
        (1, 1, False),
        (3, 2, False),
        (4, 3, False),
    ]
    envelopes = log(environment)
    assert [envelope.id for envelope in envelopes] == ["tail-1", "tail-3", "tail-4"]
    again = publish(environment, *args, stdin="\n".join(lines) + "\n")
    assert [json.loads(line)["duplicate"] for line in again.stdout.splitlines()] == [True] * 3
    assert len(log(environment)) == 3


def test_a_bad_line_ends_a_stream_by_its_number_after_the_lines_before_it(
    environment: dict[str, str],
) -> None:
    lines = [json.dumps(deploy(1)), json.dumps(deploy(2)), "{not json", json.dumps(deploy(3))]
    result = publish(
        environment, "deploy:finished", "--data-file", "-", "--stream", stdin="\n".join(lines)
    )
    assert result.exit_code == 2, result.output
    assert result.stdout.splitlines()[0].startswith("line 1: published deploy:finished ")
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: line 3 of stdin is not valid JSON: ")
    assert error.endswith("; the events of lines 1-2 were published")
    assert [envelope.data["service"] for envelope in log(environment)] == ["svc-1", "svc-2"]


def test_a_stream_that_fails_to_write_says_what_is_safe_to_do_next(
    environment: dict[str, str],
) -> None:
    refuse_events_after(environment, 2)  # the event it publishes, then one more
    lines = [json.dumps(deploy(index)) for index in range(3)]
    result = publish(
        environment, "deploy:finished", "--data-file", "-", "--stream", stdin="\n".join(lines)
    )
    assert result.exit_code == 1, result.output
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: published the events of lines 1-1, not the rest: ")
    assert error.endswith(
        "publish only the lines after line 1: without --id-prefix, publishing the file again "
        "would add the events of lines 1-1 a second time"
    )
    assert len(log(environment)) == 2


@pytest.mark.process
def test_a_stream_publishes_each_line_while_its_pipe_stays_open(
    environment: dict[str, str],
) -> None:
    """A real ``relayr publish --stream`` process: each line is in the log, and printed, before
    the next is written, while stdin is still open; ending stdin ends the process."""
    command = relayr_command(
        "publish", "acme/ops", "deploy:finished", "--data-file", "-", "--stream", "--json"
    )
    with (
        subprocess.Popen(
            command,
            cwd=REPO,
            env=environment,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as process,
        ThreadPoolExecutor(1) as reader,
    ):
        assert process.stdin is not None
        assert process.stdout is not None
        assert process.stderr is not None
        try:
            ready = reader.submit(process.stderr.readline).result(STREAM_LINE_S)
            assert "as it is read" in ready
            for index in range(1, 4):
                process.stdin.write(json.dumps(deploy(index)) + "\n")
                process.stdin.flush()
                printed = reader.submit(process.stdout.readline).result(STREAM_LINE_S)
                assert json.loads(printed)["seq"] == index
                assert [envelope.data["service"] for envelope in log(environment)] == [
                    f"svc-{number}" for number in range(1, index + 1)
                ]
            process.stdin.close()
            assert process.wait(STREAM_LINE_S) == 0, process.stderr.read()
        finally:
            process.kill()


@pytest.mark.process
def test_ctrl_c_stops_a_stream_read_from_a_terminal_and_says_what_was_published(
    environment: dict[str, str],
) -> None:
    """A stream whose input is a terminal, waiting for the next line, stops on Ctrl-C (SIGINT)
    at once, exit 130, saying which lines were published."""
    with stream_from_a_terminal(environment) as process:
        process.send_signal(signal.SIGINT)
        assert_stopped_after_line_1(process)


@pytest.mark.process
def test_ctrl_c_stops_a_stream_whichever_of_its_threads_the_kernel_hands_it_to(
    environment: dict[str, str],
) -> None:
    """The kernel may hand a process's SIGINT to any of its threads: the one blocked reading
    the terminal, the database driver's. Python runs the handler only in the main thread,
    which then sleeps in the loop with nothing to wake it; the stream stops at once all the
    same. Each thread but the main one gets the signal, in a stream of its own."""
    index, threads = 0, 1
    while index < threads:
        with stream_from_a_terminal(environment) as process:
            others = sorted(int(task) for task in os.listdir(f"/proc/{process.pid}/task"))
            others.remove(process.pid)
            threads = len(others)
            assert index < threads, others
            assert _LIBC.tgkill(process.pid, others[index], signal.SIGINT) == 0
            assert_stopped_after_line_1(process)
        index += 1


_LIBC = ctypes.CDLL(None, use_errno=True)
"""The C library, for ``tgkill``: a signal to one thread of another process."""


@contextlib.contextmanager
def stream_from_a_terminal(environment: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """A ``relayr publish --stream`` whose input is a terminal, once it has published line 1
    and waits for the next; killed after the block."""
    command = relayr_command(
        "publish", "acme/ops", "deploy:finished", "--data-file", "-", "--stream"
    )
    terminal, its_end = pty.openpty()
    with sigint_neither_blocked_nor_ignored():
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=environment,
            stdin=its_end,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    with process, ThreadPoolExecutor(1) as reader:
        os.close(its_end)
        assert process.stdout is not None
        assert process.stderr is not None
        try:
            assert "as it is read" in reader.submit(process.stderr.readline).result(STREAM_LINE_S)
            os.write(terminal, (json.dumps(deploy(1)) + "\n").encode())
            printed = reader.submit(process.stdout.readline).result(STREAM_LINE_S)
            assert printed.startswith("line 1: published deploy:finished ")
            yield process
        finally:
            process.kill()
            os.close(terminal)


@contextlib.contextmanager
def sigint_neither_blocked_nor_ignored() -> Iterator[None]:
    """SIGINT delivered to this thread, and not ignored, while a child starts, as a shell in a
    terminal starts a command: a child inherits a blocked or ignored signal, and something
    earlier in the test process may have left either."""
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def assert_stopped_after_line_1(process: subprocess.Popen[str]) -> None:
    """The stream ended as Ctrl-C ends it: exit 130, saying line 1 was published."""
    try:
        process.wait(STREAM_LINE_S)
    except subprocess.TimeoutExpired:
        status = Path(f"/proc/{process.pid}/status").read_text().splitlines()
        signals = [line for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
        pytest.fail(f"still running {STREAM_LINE_S} s after SIGINT; its signals: {signals}")
    assert process.returncode == 130
    assert process.stderr is not None
    assert process.stderr.read().strip() == "Stopped: the events of lines 1-1 were published"
