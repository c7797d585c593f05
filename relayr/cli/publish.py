"""``relayr publish``: one event, or a file of them, into a workspace's log.

One event: ``--data`` (a JSON object), ``--id`` to publish it once. Many: ``--data-file FILE``
(``-`` for stdin), one JSON object per line. Every line is checked before the first write (the
first bad one is named, exit 2, nothing published); the file goes in transactions of
:data:`CHUNK_EVENTS`. With ``--stream``, each line is checked and published as it is read, in a
transaction of its own, for a pipe that stays open (a bad line ends the stream, exit 2, the lines
before it published; Ctrl-C stops it, exit 130). ``--id-prefix P`` gives line N the id ``P-N``,
so publishing the file again adds nothing; without it, a publish that stopped half way names the
last line published. A progress bar on a terminal, when tqdm (the ``console`` extra) is
installed. Builds the application's rules part only (ADR-0050).
"""

import json
import re
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Final

import click

from relayr.cli.helpers import (
    EXIT_NOT_ALL_DONE,
    BadInput,
    Where,
    echo_json,
    fail,
    load_settings,
    parse_id,
    parse_workspace,
    run_async,
)

if TYPE_CHECKING:
    from reflexr import Event

    from relayr.settings import Settings

CHUNK_EVENTS: Final = 500
"""Events per transaction of ``--data-file``. reflexr logs a chunk atomically in one
transaction; 500 keep each one well under a second on SQLite (the write lock is held that long)
while making a 100,000-line file 200 transactions instead of 100,000."""


STREAM_AHEAD: Final = 100
"""How many lines ``--stream`` reads ahead of what it has published."""

EXIT_INTERRUPTED: Final = 130
"""``--stream`` stopped by Ctrl-C (SIGINT), as a shell reports a command it interrupted."""

UNDECODED_BYTE: Final = re.compile("[\udc80-\udcff]")
"""What ``surrogateescape`` makes of a byte that is not UTF-8: a lone surrogate, which no
decoded text holds."""


@dataclass(frozen=True)
class Line:
    """One line of ``--data-file``: its number, its JSON object, and the event's id if given."""

    number: int
    data: dict[str, Any]
    id: str | None


@dataclass(frozen=True)
class Loaded:
    """One event of ``--data-file``, checked: the line it came from, the event, its id."""

    number: int
    event: "Event"
    id: str | None


def parse_data(value: str, *, where: str = "--data") -> dict[str, Any]:
    """Read an event's fields as a JSON object; raise :class:`BadInput` naming the problem."""
    try:
        data = json.loads(value)
    except json.JSONDecodeError as error:
        fail(f"{where} is not valid JSON: {error}")
    if not isinstance(data, dict):
        fail(f"{where} must be a JSON object, not {type(data).__name__}")
    return data


def describe(errors: Sequence[Any]) -> str:
    """Pydantic's validation errors as one line: ``status: Field required; ...``."""
    problems = []
    for error in errors:
        if isinstance(error, dict):
            where = ".".join(str(part) for part in error.get("loc", ())) or "event"
            problems.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(problems)


def holds_nul(value: object) -> bool:
    """Whether a string in ``value`` (a JSON value) holds a NUL character, which no storage
    keeps (reflexr refuses it): checked here to name the line."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(holds_nul(key) or holds_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(holds_nul(item) for item in value)
    return False


def load(event_type: str | None, data: dict[str, Any], *, where: str) -> "Event":
    """The event ``data`` describes (of ``event_type``, or of the type it names).

    Raises:
        BadInput: Naming ``where`` and the problem, when it is no valid, known event.
    """
    from reflexr.core import UnknownEvent, ValidationFailed, load_event

    if event_type is not None and "type" in data:
        fail(f"{where} must not contain 'type': the event type is the EVENT_TYPE argument")
    named = event_type if event_type is not None else data.get("type")
    if not isinstance(named, str):
        fail(f"{where} names no event type: give EVENT_TYPE, or 'type' on each line")
    if holds_nul(data):
        fail(f"{where}: text cannot hold a NUL character")
    try:
        event = load_event({**data, "type": named})
    except ValidationFailed as invalid:
        fail(f"{where}: invalid {named} event: {describe(invalid.errors) or invalid.message}")
    if isinstance(event, UnknownEvent):
        fail(f"{where}: unknown event type {named!r}")
    return event


def read_lines(file: IO[str], id_prefix: str | None) -> list[Line]:
    """Every line of ``file`` as a JSON object; blank lines are skipped.

    ``file`` is read with ``errors="surrogateescape"`` (``--data-file``'s type), so a byte that is
    not UTF-8 reaches this function as a lone surrogate in its line instead of failing the read
    of a whole chunk: its line is named here.

    Raises:
        BadInput: Naming the first line that is not UTF-8 text or not a JSON object, by its
            number.
    """
    lines = []
    for number, text in enumerate(file, start=1):
        line = read_line(number, text, _name(file), id_prefix)
        if line is not None:
            lines.append(line)
    if not lines:
        fail(f"{_name(file)} has no event: one JSON object per line")
    return lines


def read_line(number: int, text: str, source: str, id_prefix: str | None) -> Line | None:
    """Line ``number`` of ``source`` as a JSON object, or None when it is blank.

    Raises:
        BadInput: Naming the line when it is not UTF-8 text or not a JSON object.
    """
    undecodable = _undecodable(text)
    if undecodable is not None:
        column, byte = undecodable
        fail(f"line {number} of {source} is not UTF-8 text: byte 0x{byte:02x} at column {column}")
    if not text.strip():
        return None
    data = parse_data(text, where=f"line {number} of {source}")
    return Line(number, data, None if id_prefix is None else f"{id_prefix}-{number}")


def load_lines(lines: Sequence[Line], event_type: str | None, source: str) -> list[Loaded]:
    """Each line's event (once the application's event types are known).

    Raises:
        BadInput: Naming the first line that is no valid event of a known type.
    """
    return [
        Loaded(
            line.number,
            load(event_type, line.data, where=f"line {line.number} of {source}"),
            line.id,
        )
        for line in lines
    ]


def _name(file: IO[str]) -> str:
    """The file's path, or ``stdin`` (whose text stream click may make without a name)."""
    name = getattr(file, "name", "<stdin>")
    return "stdin" if name == "<stdin>" else str(name)


def _undecodable(text: str) -> tuple[int, int] | None:
    """The column and value of the first byte of ``text`` that was not UTF-8 (a lone surrogate
    ``surrogateescape`` left in its place), or None. A JSON escape such as ``\\udc80`` is
    still six characters here, so only a byte that could not be decoded is found."""
    found = UNDECODED_BYTE.search(text)
    return None if found is None else (found.start() + 1, ord(found[0]) - 0xDC00)


def chunks(lines: Sequence[Loaded], size: int = CHUNK_EVENTS) -> list[Sequence[Loaded]]:
    """``lines`` in transactions of ``size``, except the first, which reaches past the first
    event of every type: reflexr checks a whole list before its transaction, so every type is
    accepted or refused before anything is written."""
    first_of_type: dict[str, int] = {}
    for index, line in enumerate(lines):
        first_of_type.setdefault(line.event.event_type, index)
    first = max(size, max(first_of_type.values()) + 1)
    return [lines[:first]] + [lines[i : i + size] for i in range(first, len(lines), size)]


def refused_line(lines: Sequence[Loaded], message: str) -> int | None:
    """The line of the first event whose type reflexr's refusal names, if it names one."""
    for line in lines:
        if message.startswith(f"{line.event.event_type} ") or message.endswith(
            f" {line.event.event_type} does not exist"
        ):
            return line.number
    return None


@click.command()
@click.argument("where", metavar="TENANT/WORKSPACE")
@click.argument("event_type", required=False)
@click.option(
    "--data",
    "data_text",
    default=None,
    help='The event\'s fields, as a JSON object (default: "{}").',
)
@click.option(
    "--data-file",
    type=click.File("r", encoding="utf-8", errors="surrogateescape"),
    default=None,
    help="Many events: one JSON object per line (with 'type' when EVENT_TYPE is left out); "
    "'-' reads stdin. All are checked before the first is published.",
)
@click.option(
    "--id",
    "event_id",
    default=None,
    help="The event's id: publishing an id again adds nothing (idempotent).",
)
@click.option(
    "--id-prefix",
    default=None,
    help="With --data-file: line N's event gets the id PREFIX-N, so publishing the file again "
    "adds nothing.",
)
@click.option(
    "--stream",
    is_flag=True,
    help="With --data-file: publish each line as it is read, in a transaction of its own, and "
    "print it (for a pipe that stays open); a bad line ends the stream, the lines before it "
    "published.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def publish(
    where: str,
    event_type: str | None,
    data_text: str | None,
    data_file: IO[str] | None,
    event_id: str | None,
    id_prefix: str | None,
    stream: bool,
    as_json: bool,
) -> None:
    """Publish an event, or a file of events, into a workspace's log; the dispatcher evaluates
    the rules on them.

    Examples: relayr publish acme/ops deploy:finished --data '{"service": "api",
    "status": "succeeded", "thread_id": "thr_..."}'; relayr publish acme/ops --data-file
    events.jsonl --id-prefix import-7; tail -f events.jsonl | relayr publish acme/ops --data-file -
    --stream
    """
    workspace = parse_workspace(where)
    if event_type is not None:
        parse_id("EVENT_TYPE", event_type)
    if data_file is None:
        if stream:
            fail("--stream publishes the lines of --data-file as they come: give --data-file")
        if id_prefix is not None:
            fail("--id-prefix numbers the lines of --data-file: use --id for one event")
        if event_type is None:
            fail("give EVENT_TYPE, or --data-file with 'type' on each line")
        data = parse_data(data_text if data_text is not None else "{}")
        if event_id is not None:
            parse_id("--id", event_id)
        _publish_one(load_settings(), workspace, event_type, data, event_id, as_json)
        return
    if data_text is not None:
        fail("give --data or --data-file, not both")
    if event_id is not None:
        fail("--id names one event: with --data-file, use --id-prefix")
    if id_prefix is not None:
        parse_id("--id-prefix", id_prefix)
    if stream:
        _publish_stream(load_settings(), workspace, data_file, event_type, id_prefix, as_json)
        return
    lines = read_lines(data_file, id_prefix)
    settings = load_settings()
    _publish_lines(settings, workspace, lines, event_type, _name(data_file), id_prefix, as_json)


def _publisher() -> Any:
    """Who publishes events from the command line, as reflexr records it."""
    from reflexr import SourceActor

    return SourceActor(name="relayr-cli")


def _publish_one(
    settings: "Settings",
    workspace: Where,
    event_type: str,
    data: dict[str, Any],
    event_id: str | None,
    as_json: bool,
) -> None:
    from reflexr.core import Forbidden, NotFound

    from relayr.runtime.application_parts import opened_rules

    async def main() -> dict[str, Any]:
        async with opened_rules(settings) as rules:
            event = load(event_type, data, where="--data")
            handle = await rules.open(
                workspace.tenant_id, workspace.workspace_id, actor=_publisher()
            )
            try:
                published = await handle.publish(event, id=event_id)
            except NotFound:
                fail(f"event type {event_type!r} is not one this application accepts")
            except Forbidden as refused:
                fail(f"event type {event_type!r} cannot be published: {refused.message}")
        return _published(published, event_type)

    result = run_async(main())
    if as_json:
        echo_json(result)
    else:
        click.echo(_said(result))


def _publish_lines(
    settings: "Settings",
    workspace: Where,
    lines: Sequence[Line],
    event_type: str | None,
    source: str,
    id_prefix: str | None,
    as_json: bool,
) -> None:
    from reflexr.core import Forbidden, NotFound

    from relayr.runtime.application_parts import opened_rules

    done: list[Any] = []
    transactions = 0

    async def main() -> None:
        nonlocal transactions
        async with opened_rules(settings) as rules:
            parts = chunks(load_lines(lines, event_type, source))
            handle = await rules.open(
                workspace.tenant_id, workspace.workspace_id, actor=_publisher()
            )
            with _progress(len(lines)) as progress:
                for index, part in enumerate(parts):
                    try:
                        published = await handle.publish_many(
                            [line.event for line in part], ids=[line.id for line in part]
                        )
                    except (NotFound, Forbidden) as refused:
                        if index > 0:
                            raise
                        number = refused_line(part, refused.message)
                        at = f"line {number}: " if number is not None else ""
                        fail(f"{at}{refused.message}; nothing was published")
                    done.extend(published)
                    transactions += 1
                    progress.update(len(part))

    try:
        run_async(main())
    except BadInput:
        raise
    except Exception as error:
        if not done:
            raise
        last = lines[len(done) - 1].number
        click.echo(
            f"Error: published the events of lines 1-{last} ({len(done)}), not the rest: "
            f"{_one_line(error)}; {_again(id_prefix, last)}",
            err=True,
        )
        sys.exit(EXIT_NOT_ALL_DONE)
    added = [result for result in done if not result.duplicate]
    summary = {
        "events": len(done),
        "added": len(added),
        "duplicates": len(done) - len(added),
        "first_seq": min(result.envelope.seq for result in done),
        "last_seq": max(result.envelope.seq for result in done),
        "transactions": transactions,
    }
    if as_json:
        echo_json(summary)
    else:
        again = f", {summary['duplicates']} already published" if summary["duplicates"] else ""
        click.echo(
            f"published {summary['added']} event(s) into {workspace}{again}, seq "
            f"{summary['first_seq']}-{summary['last_seq']}, in {summary['transactions']} "
            "transaction(s)"
        )


def _publish_stream(
    settings: "Settings",
    workspace: Where,
    file: IO[str],
    event_type: str | None,
    id_prefix: str | None,
    as_json: bool,
) -> None:
    """Publish each line of ``file`` as it is read, until it ends; print each event published,
    at once. Says on stderr when it reads, so a program feeding the pipe knows it is ready."""
    from reflexr.core import Forbidden, NotFound

    from relayr.runtime.application_parts import opened_rules

    source = _name(file)
    reading = False
    last = 0

    async def main() -> None:
        nonlocal reading, last
        async with opened_rules(settings) as rules:
            handle = await rules.open(
                workspace.tenant_id, workspace.workspace_id, actor=_publisher()
            )
            click.echo(
                f"publishing each line of {source} into {workspace} as it is read; "
                "end the input to stop",
                err=True,
            )
            reading = True
            number = 0
            async for text in _lines_as_read(file):
                number += 1
                line = read_line(number, text, source, id_prefix)
                if line is None:
                    continue
                where = f"line {number} of {source}"
                event = load(event_type, line.data, where=where)
                try:
                    published = await handle.publish(event, id=line.id)
                except (NotFound, Forbidden) as refused:
                    fail(f"{where}: {refused.message}")
                last = number
                _echo_published(published, event.event_type, number, as_json)

    try:
        run_async(main())
    except KeyboardInterrupt:
        click.echo(f"Stopped: {_published_before(last)}", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except BadInput as bad:
        if not reading:
            raise
        raise BadInput(f"{bad.message}; {_published_before(last)}") from None
    except Exception as error:
        if not last:
            raise
        click.echo(
            f"Error: published the events of lines 1-{last}, not the rest: {_one_line(error)}; "
            f"{_again(id_prefix, last)}",
            err=True,
        )
        sys.exit(EXIT_NOT_ALL_DONE)


async def _lines_as_read(file: IO[str]) -> AsyncIterator[str]:
    """The lines of ``file`` as they are read, by a daemon thread a few lines ahead: a thread
    of the loop's executor blocked on a terminal would hold the process at its exit (after a
    Ctrl-C) until a line came."""
    import asyncio
    import threading

    loop = asyncio.get_running_loop()
    read: asyncio.Queue[str | Exception | None] = asyncio.Queue(maxsize=STREAM_AHEAD)

    def hand(item: str | Exception | None) -> None:
        asyncio.run_coroutine_threadsafe(read.put(item), loop).result()

    def reader() -> None:
        try:
            try:
                for text in iter(file.readline, ""):
                    hand(text)
            except Exception as error:  # raised in the loop, as the read's own error
                hand(error)
            else:
                hand(None)
        except BaseException:  # the loop has ended: nobody reads any more
            return

    threading.Thread(target=reader, name="relayr-publish-input", daemon=True).start()
    while (item := await read.get()) is not None:
        if isinstance(item, Exception):
            raise item
        yield item


def _published(published: Any, event_type: str) -> dict[str, Any]:
    """What publishing one event did, as ``--json`` prints it."""
    envelope = published.envelope
    return {
        "id": envelope.id,
        "seq": envelope.seq,
        "type": event_type,
        "duplicate": published.duplicate,
    }


def _said(result: dict[str, Any]) -> str:
    """:func:`_published`'s result as a line of text."""
    again = " (already published: nothing added)" if result["duplicate"] else ""
    return f"published {result['type']} {result['id']} at seq {result['seq']}{again}"


def _echo_published(published: Any, event_type: str, number: int, as_json: bool) -> None:
    """One line for an event ``--stream`` published, flushed: a pipe's reader sees it now."""
    result = {"line": number, **_published(published, event_type)}
    if as_json:
        echo_json(result)
    else:
        click.echo(f"line {number}: {_said(result)}")
    sys.stdout.flush()


def _published_before(last: int) -> str:
    """What a stream that stopped at a bad line had published."""
    if not last:
        return "nothing was published"
    return f"the events of lines 1-{last} were published"


def _one_line(error: Exception) -> str:
    """The error as one line: the database driver's own error when SQLAlchemy wraps one (its
    message runs over lines of SQL and parameters), else the error's first line."""
    cause = getattr(error, "orig", None)
    shown = cause if isinstance(cause, Exception) else error
    lines = str(shown).strip().splitlines()
    return f"{type(shown).__name__}: {lines[0] if lines else '-'}"


def _again(id_prefix: str | None, last: int) -> str:
    """What is safe to do after the lines up to ``last`` were published and the rest were not."""
    if id_prefix is not None:
        return (
            f"publishing the file again with the same --id-prefix {id_prefix} adds only what is "
            "missing"
        )
    return (
        f"publish only the lines after line {last}: without --id-prefix, publishing the file "
        f"again would add the events of lines 1-{last} a second time"
    )


class _NoProgress:
    def update(self, count: int) -> None:
        """Nothing: stderr is not a terminal."""

    def __enter__(self) -> "_NoProgress":
        return self

    def __exit__(self, *_: object) -> None:
        return None


def _progress(total: int) -> Any:
    """A progress bar on stderr when it is a terminal and tqdm (the ``console`` extra) is
    installed, else one that shows nothing."""
    if not sys.stderr.isatty():
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, unit="event", file=sys.stderr, leave=False)
