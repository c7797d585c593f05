"""The example allowlist file, mutated on disk: a load refuses it whole or grants exactly what
it states, and a worker reloading it has it in force or keeps the last good allowlist.

Under hypothesis, on real files in a temporary folder: the bytes mutated (invalid UTF-8, BOMs,
NULs) through ``load_allowlist``, and ``AllowlistFile.reload`` of the text mutations and the
parser escapes of tests/allowlist_mutations.py.
"""

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relayr.core.allowlist import Allowlists
from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.errors import InvalidAllowlist
from relayr.runtime.allowlist_file import AllowlistFile, load_allowlist
from tests.allowlist_helpers import Clock
from tests.allowlist_mutations import (
    ESCAPES,
    EXAMPLE,
    PROBES,
    Mutation,
    assert_refused_or_granted_as_written,
    mutated,
    mutations,
)


@st.composite
def byte_mutations(draw: st.DrawFn) -> bytes:
    raw = bytearray(EXAMPLE.encode())
    if draw(st.booleans()):
        raw[:0] = b"\xef\xbb\xbf"
    for _ in range(draw(st.integers(min_value=1, max_value=8))):
        position = draw(st.integers(min_value=0, max_value=len(raw)))
        kind = draw(st.sampled_from(["flip", "insert", "delete"]))
        if kind == "flip" and position < len(raw):
            raw[position] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif kind == "insert":
            raw[position:position] = draw(
                st.binary(min_size=1, max_size=4)
                | st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\n"])
            )
        else:
            del raw[position : position + draw(st.integers(min_value=1, max_value=8))]
    return bytes(raw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("allowlists")


@settings(max_examples=200, deadline=None)
@given(byte_mutations())
def test_a_file_mutated_byte_wise_is_refused_whole_or_granted_as_written(
    folder: Path, raw: bytes
) -> None:
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".toml", delete=False) as file:
        file.write(raw)
    path = Path(file.name)
    refused: InvalidAllowlist | None = None
    loaded: Allowlists | None = None
    try:
        loaded = load_allowlist(path)
    except InvalidAllowlist as invalid:
        refused = invalid
    finally:
        path.unlink()
    if refused is not None:
        assert refused.source == str(path)
        assert refused.problems
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        assert loaded is None
        return
    verdict = assert_refused_or_granted_as_written(text)
    assert verdict == ("refused" if loaded is None else "parsed")
    if loaded is not None:
        parsed = parse_allowlist(text)
        assert [loaded.for_rule(rule) for rule in PROBES] == [
            parsed.for_rule(rule) for rule in PROBES
        ]


@settings(max_examples=60, deadline=None)
@given(st.lists(mutations, min_size=1, max_size=4))
def test_a_worker_reloading_a_mutated_file_keeps_the_last_good_one_or_takes_it_whole(
    folder: Path, changes: list[Mutation]
) -> None:
    path = folder / f"reload-{id(changes)}.toml"
    path.write_text(EXAMPLE)
    invalid: list[InvalidAllowlist] = []
    clock = Clock()
    allowlist_file = AllowlistFile.open(
        path, clock=clock, on_invalid=invalid.append, on_reload=lambda _: None
    )
    good = allowlist_file.current()
    text = mutated(changes, "\n")
    path.write_text(text)
    try:
        in_force = allowlist_file.reload()
    finally:
        path.unlink()
    verdict = assert_refused_or_granted_as_written(text)
    if verdict == "refused":
        assert in_force is good
        assert len(invalid) == 1
        assert allowlist_file.last_error is invalid[0]
    else:
        assert invalid == []
        for rule in PROBES:
            assert in_force.for_rule(rule) == parse_allowlist(text).for_rule(rule)


@pytest.mark.parametrize("text", ESCAPES.values(), ids=ESCAPES.keys())
def test_a_worker_reloading_such_a_file_keeps_the_last_good_allowlist(
    tmp_path: Path, text: str
) -> None:
    path = tmp_path / "allowlist.toml"
    path.write_text(EXAMPLE)
    invalid: list[InvalidAllowlist] = []
    allowlist_file = AllowlistFile.open(path, on_invalid=invalid.append)
    good = allowlist_file.current()
    path.write_text(text)
    assert allowlist_file.reload() is good
    assert len(invalid) == 1
