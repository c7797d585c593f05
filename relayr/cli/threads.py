"""``relayr thread create``, ``post`` and ``show``: open a thread, write in it, read it.

A person trying a rule by hand creates a thread, publishes an event that names it, and reads
the thread: people's messages, the rules' notices (marked ``[notice]``) and messages, and the
agent's replies. ``post --notice`` writes a person's notice, which starts no turn and resumes
no paused one (the agent's turns are the workers'; a message for the agent is not posted here).
These commands build only the application's artifacts part (artifactr, ADR-0050): no reflexr,
no agent, no actions.
"""

from dataclasses import asdict
from typing import TYPE_CHECKING

import click

from relayr.cli.helpers import echo_json, fail, load_settings, parse_id, parse_workspace, run_async
from relayr.ops.transcript import ThreadEntry, marker, read_thread

if TYPE_CHECKING:
    from artifactr import UserActor

CLI_USER_ID = "relayr-cli"
CLI_USER_NAME = "relayr CLI"
"""Who creates threads and reads them from the command line, as artifactr records it
(``user:relayr-cli``); the demo acts as the same user (:data:`relayr.demo.CLI_USER`)."""


def cli_user() -> "UserActor":
    """The command line's artifactr user (:data:`CLI_USER_ID`)."""
    from artifactr import UserActor

    return UserActor(id=CLI_USER_ID, name=CLI_USER_NAME)


def format_entry(entry: ThreadEntry) -> str:
    """One message for people: ``#seq [notice] author (id)``, then its content, indented."""
    content = entry.content.replace("\n", "\n    ")
    return f"#{entry.seq} {marker(entry.kind)} {entry.author} ({entry.id})\n    {content}"


@click.group()
def thread() -> None:
    """Create artifactr threads and read them."""


@thread.command("create")
@click.argument("where", metavar="TENANT/WORKSPACE")
@click.option("--title", required=True, help="The thread's title.")
@click.option("--json", "as_json", is_flag=True, help='Print {"id": ...}.')
def thread_create(where: str, title: str, as_json: bool) -> None:
    """Create a thread and print its id."""
    workspace = parse_workspace(where)
    settings = load_settings()

    async def main() -> str:
        from relayr.runtime.application_parts import opened_artifacts

        async with opened_artifacts(settings) as artifacts:
            handle = await artifacts.open(
                workspace.tenant_id, workspace.workspace_id, actor=cli_user()
            )
            return (await handle.create_thread(title)).id

    thread_id = run_async(main())
    if as_json:
        echo_json({"id": thread_id})
    else:
        click.echo(thread_id)


@thread.command("show")
@click.argument("where", metavar="TENANT/WORKSPACE")
@click.argument("thread_id", metavar="THREAD")
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON list of {id, kind, author, content, seq}."
)
def thread_show(where: str, thread_id: str, as_json: bool) -> None:
    """Print every message of a thread: notices, messages and the agent's replies."""
    workspace = parse_workspace(where)
    parse_id("THREAD", thread_id)
    settings = load_settings()

    async def main() -> list[ThreadEntry]:
        from artifactr.core import NotFound

        from relayr.runtime.application_parts import opened_artifacts

        async with opened_artifacts(settings) as artifacts:
            handle = await artifacts.open(
                workspace.tenant_id, workspace.workspace_id, actor=cli_user()
            )
            try:
                await handle.thread(thread_id)
            except NotFound:
                fail(f"thread {thread_id} does not exist in {workspace}")
            return await read_thread(handle, thread_id)

    entries = run_async(main())
    if as_json:
        echo_json([asdict(entry) for entry in entries])
    else:
        for entry in entries:
            click.echo(format_entry(entry))


@thread.command("post")
@click.argument("where", metavar="TENANT/WORKSPACE")
@click.argument("thread_id", metavar="THREAD")
@click.argument("content")
@click.option(
    "--notice",
    is_flag=True,
    help="Post a notice: for people, it starts no agent turn and resumes no paused one.",
)
@click.option("--json", "as_json", is_flag=True, help='Print {"id": ..., "kind": "notice"}.')
def thread_post(where: str, thread_id: str, content: str, notice: bool, as_json: bool) -> None:
    """Post CONTENT in a thread as a notice (--notice); print its message id."""
    from relayr.core.routing import text_problem

    workspace = parse_workspace(where)
    parse_id("THREAD", thread_id)
    if not notice:
        fail(
            "only a notice can be posted from the command line (--notice): a message for the "
            "agent starts a turn, which the workers run"
        )
    if not content.strip():
        fail("CONTENT is empty")
    problem = text_problem(content)
    if problem is not None:
        fail(f"CONTENT {problem}")
    settings = load_settings()

    async def main() -> str:
        from artifactr.core import NotFound, new_message_id

        from relayr.runtime.application_parts import opened_artifacts

        message_id = new_message_id()
        async with opened_artifacts(settings) as artifacts:
            handle = await artifacts.open(
                workspace.tenant_id, workspace.workspace_id, actor=cli_user()
            )
            try:
                await handle.thread(thread_id)
            except NotFound:
                fail(f"thread {thread_id} does not exist in {workspace}")
            await handle.post_message(thread_id, content, message_id=message_id, kind="notice")
        return message_id

    message_id = run_async(main())
    if as_json:
        echo_json({"id": message_id, "kind": "notice"})
    else:
        click.echo(message_id)
