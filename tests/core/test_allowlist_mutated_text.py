"""The example allowlist file, mutated as text: refused whole, or granted exactly as written.

Pure, under hypothesis: the mutations and the reference interpreter of
tests/allowlist_mutations.py, given to ``parse_allowlist``; and the inputs that once escaped
the parser as another exception than ``InvalidAllowlist``.
"""

import tomllib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.errors import InvalidAllowlist
from tests.allowlist_mutations import (
    ESCAPES,
    EXAMPLE,
    Mutation,
    Stated,
    assert_refused_or_granted_as_written,
    mutated,
    mutations,
    stated,
    valid_leaning,
)


def test_the_example_file_grants_as_written() -> None:
    assert assert_refused_or_granted_as_written(EXAMPLE) == "parsed"
    assert stated(tomllib.loads(EXAMPLE), "ops:incident-triage") == Stated(turns=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutations, min_size=1, max_size=6), st.sampled_from(["\n", "", "\r\n", "\n\n"]))
def test_a_mutated_file_is_refused_whole_or_granted_as_written(
    changes: list[Mutation], ending: str
) -> None:
    assert_refused_or_granted_as_written(mutated(changes, ending))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(valid_leaning, min_size=1, max_size=6))
def test_entries_added_moved_or_removed_grant_only_what_they_state(
    changes: list[Mutation],
) -> None:
    assert_refused_or_granted_as_written(mutated(changes, "\n"))


@pytest.mark.parametrize("text", ESCAPES.values(), ids=ESCAPES.keys())
def test_what_tomllib_cannot_read_is_refused_not_a_crash(text: str) -> None:
    with pytest.raises(InvalidAllowlist):
        parse_allowlist(text)
