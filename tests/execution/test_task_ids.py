"""A run task's ids: refused or read faithfully, and ids that point at nothing write nothing.

A run task carries three ids and the store decides the rest (ADR-0001; README, "Commands").
``tasks.runs.parse_ids`` under hypothesis: whatever the arguments (wrong types, missing, extra
or repeated fields, huge strings, NUL, unicode), it returns three well-formed ids read
faithfully or raises ``InvalidTask``, nothing else. Then a claim and a failure of a run that
does not exist, on a real runtime on SQLite, leave every table as it was.

Escapes found here, and that are now refused: an id given by position and by name, ids with
lone surrogates, the workspace row a missing run's claim left. What a real worker does with
such messages is in tests/broker/test_hostile_messages.py.
"""

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayr.core.errors import InvalidTask
from relayr.execution import executor
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tasks.runs import ID_NAMES, MAX_ID_LENGTH, RunIds, parse_ids
from tests.stored_rows import database_file, table_rows
from tests.workers import ALLOWLIST

# ─── parse_ids under hypothesis ───────────────────────────────────────────────

SPECIAL_TEXTS = [
    "",
    " ",
    "\t\n",
    "\x00",
    "fir_\x00",
    "\u00a0",
    "\u200b",
    "é",
    "e\u0301",
    "שלום",
    "🚀",
    "\ufeff",
    "' OR 1=1 --",
    "../../etc/passwd",
    "%s%n",
    "fir_0123456789abcdef",
    "x" * MAX_ID_LENGTH,
    "x" * (MAX_ID_LENGTH + 1),
]

long_texts = st.builds(
    lambda count, char: char * count,
    st.integers(min_value=MAX_ID_LENGTH - 2, max_value=12_000),
    st.sampled_from(["x", " ", "\x00", "é", "🚀"]),
)
texts = st.text(max_size=24) | st.sampled_from(SPECIAL_TEXTS) | long_texts
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.binary(max_size=8)
    | texts
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
well_formed = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=40
).filter(str.strip)
arguments = well_formed | values
names = (
    st.sampled_from(ID_NAMES) | st.text(max_size=12) | st.sampled_from(["ID", "run", "x" * 5000])
)


def faithful_reading(args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What the three ids are when the message is well formed: by position, then by name."""
    given_ = dict(zip(ID_NAMES, args, strict=False))
    for name in ID_NAMES[len(args) :]:
        given_[name] = kwargs[name]
    return tuple(given_[name] for name in ID_NAMES)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(arguments, max_size=5), st.dictionaries(names, arguments, max_size=4))
def test_parse_ids_reads_three_ids_faithfully_or_raises_invalid_task(
    args: list[Any], kwargs: dict[str, Any]
) -> None:
    try:
        ids = parse_ids(args, kwargs)
    except InvalidTask as invalid:
        refused: InvalidTask | None = invalid
    else:
        refused = None
    if refused is not None:
        assert refused.code == "invalid_task"
        assert refused.message[:1].islower()
        assert refused.message.startswith(("task argument", "expected 3", "unexpected task"))
        return
    assert len(args) <= len(ID_NAMES)
    assert set(kwargs) <= set(ID_NAMES)
    assert ids.as_args() == faithful_reading(args, kwargs)
    for value in ids.as_args():
        assert type(value) is str
        assert value.strip()
        assert len(value) <= MAX_ID_LENGTH
        assert "\x00" not in value


@settings(max_examples=200, deadline=None)
@given(st.permutations(range(3)), well_formed, well_formed, well_formed)
def test_ids_by_name_in_any_order_read_the_same(
    order: list[int], tenant: str, workspace: str, run: str
) -> None:
    values_ = (tenant, workspace, run)
    kwargs = {ID_NAMES[index]: values_[index] for index in order}
    assert parse_ids((), kwargs) == RunIds(tenant, workspace, run)


def test_an_id_given_twice_is_refused() -> None:
    with pytest.raises(InvalidTask, match="tenant_id"):
        parse_ids(("acme", "ops"), {"tenant_id": "evil", "run_id": "fir_1"})


@pytest.mark.parametrize(
    "run_id", ["fir_" + chr(0xD800), chr(0xDFFF), "fir_" + chr(0xD83D)], ids=["high", "low", "half"]
)
def test_an_id_that_is_not_unicode_text_is_refused(run_id: str) -> None:
    with pytest.raises(InvalidTask, match="run_id"):
        parse_ids(("acme", "ops", run_id), {})


# ─── a claim that finds nothing writes nothing ───────────────────────────────


async def test_a_claim_of_a_missing_run_leaves_no_workspace_row(tmp_path: Path) -> None:
    settings_ = Settings(home=tmp_path, allowlist=ALLOWLIST)
    runtime = await Runtime.start(settings_, role="dispatcher")
    async with runtime:
        before = table_rows(database_file(settings_))
        claimed = await executor.execute_run(runtime, "ghost", "nowhere", "fir_0000000000000000")
        failed = await executor.fail_run(
            runtime, "ghost", "elsewhere", "fir_0000000000000000", reason="worker_lost", error="-"
        )
        after = table_rows(database_file(settings_))
    assert (claimed.outcome, failed.outcome) == ("missing", "missing")
    assert after == before
