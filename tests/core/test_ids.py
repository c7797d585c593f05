"""Derived ids: a pure function of the run and what the write is."""

import re

import pytest

from relayr.core.ids import IdDeriver, derive_id, digest

RUN = "fir_0123456789abcdef"


def test_the_shape_is_a_prefix_and_sixteen_hex_digits() -> None:
    for prefix in ("msg", "thr", "prp", "art"):
        made = derive_id(prefix, run_id=RUN, segment=0, operation="x", subject=("a",), ordinal=0)
        assert re.fullmatch(rf"{prefix}_[0-9a-f]{{16}}", made)


@pytest.mark.parametrize(
    "change",
    [
        {"run_id": "fir_other"},
        {"segment": 1},
        {"operation": "create_thread"},
        {"subject": ("thr_b", digest("hello"))},
        {"subject": ("thr_a", digest("hello!"))},
        {"ordinal": 1},
    ],
)
def test_each_input_changes_the_id(change: dict[str, object]) -> None:
    base: dict[str, object] = {
        "run_id": RUN,
        "segment": 0,
        "operation": "post_message",
        "subject": ("thr_a", digest("hello")),
        "ordinal": 0,
    }
    assert derive_id("msg", **base) != derive_id("msg", **{**base, **change})  # type: ignore[arg-type]


def test_subject_parts_cannot_run_into_each_other() -> None:
    one = derive_id("msg", run_id=RUN, segment=0, operation="o", subject=("ab", "c"), ordinal=0)
    two = derive_id("msg", run_id=RUN, segment=0, operation="o", subject=("a", "bc"), ordinal=0)
    assert one != two


def test_an_attempt_counts_identical_writes_and_the_next_attempt_repeats_them() -> None:
    def attempt() -> list[str]:
        ids = IdDeriver(RUN)
        subject = ("thr_a", digest("same"))
        return [
            ids.next("msg", segment=0, operation="post_message", subject=subject),
            ids.next("msg", segment=0, operation="post_message", subject=("thr_a", digest("x"))),
            ids.next("msg", segment=0, operation="post_message", subject=subject),
        ]

    first, second = attempt(), attempt()
    assert first == second
    assert len(set(first)) == 3


def test_a_pair_of_ids_counts_as_one_write() -> None:
    ids = IdDeriver(RUN)
    proposal, artifact = ids.next_ids(("prp", "art"), segment=0, operation="c", subject=("k",))
    assert proposal[4:] == artifact[4:]
    assert ids.next("prp", segment=0, operation="c", subject=("k",)) != proposal


def test_content_with_lone_surrogates_still_has_a_digest() -> None:
    assert digest("\udcff") != digest("")
