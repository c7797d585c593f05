"""The console's search by id, on real storage (SQLite and PostgreSQL): every kind of id is
found, a run's id without reading any workspace, and an id whose prefix names another kind
than its own is still found."""

from reflexr import SourceActor

from relayr.console.search import search
from relayr.ops.index import RunIndex
from tests.ops.ops_harness import TENANT, Flaked, Ops
from tests.ops.ops_harness import ops as ops
from tests.ops.test_run_index import engine_of, statements


def index_of(ops: Ops) -> RunIndex:
    return RunIndex(ops.rules, engine=engine_of(ops))


async def test_every_kind_of_id_is_found_where_it_is(ops: Ops) -> None:
    thread = await ops.thread()
    run_id = await ops.fire(Flaked(thread_id=thread))
    assert await ops.until_ended(run_id) == "dead"
    [(posted, _)] = (await ops.posted(thread))[:1]
    index = index_of(ops)
    handle = await ops.rules.open(TENANT, "ops", actor=SourceActor(name="test"))
    [envelope] = [env for env in await handle.read() if env.event_type == "opstest:flaked"]
    wanted = {
        run_id: {"run"},
        envelope.id: {"event"},
        thread: {"thread"},
        posted.message_id: {"message", "message's run"},
    }
    for found_id, kinds in wanted.items():
        found = await search(ops.runtime, found_id, index)
        assert not found.text, found_id
        assert {hit.kind for hit in found.hits} == kinds, found_id
        assert {str(hit.workspace) for hit in found.hits} == {f"{TENANT}/ops"}, found_id


async def test_a_run_id_is_found_in_the_index_without_reading_a_workspace(ops: Ops) -> None:
    thread = await ops.thread()
    run_ids = [await ops.fire(Flaked(thread_id=thread), f"w{number}") for number in range(5)]
    index = index_of(ops)
    await index.refreshed()
    with statements(engine_of(ops)) as seen:
        found = await search(ops.runtime, run_ids[3], index)
    holders = [f"w{number}" for number, held in enumerate(run_ids) if held == run_ids[3]]
    assert [(hit.kind, hit.workspace.workspace_id) for hit in found.hits] == [
        ("run", where) for where in holders
    ]
    assert sum("reflexr_workspaces" in statement for statement in seen) == 1, seen
    assert not [statement for statement in seen if "reflexr_events" in statement], seen


async def test_an_id_whose_prefix_names_another_kind_is_still_found(ops: Ops) -> None:
    """An event's id is its publisher's to choose: ``thr_...`` is looked for as a thread
    first, and as any kind when no thread has it."""
    handle = await ops.rules.open(TENANT, "ops", actor=SourceActor(name="test"))
    thread = await ops.thread()
    published = await handle.publish(Flaked(thread_id=thread), id="thr_chosen_by_a_publisher")
    found = await search(ops.runtime, "thr_chosen_by_a_publisher", index_of(ops))
    assert [(hit.kind, hit.link) for hit in found.hits] == [
        ("event", f"/event?workspace={TENANT}%2Fops&seq={published.envelope.seq}")
    ]
