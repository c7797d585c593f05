"""Limits in the allowlist file: parsed, matched, explained, and a bad one refused whole.

Pure: ``parse_allowlist`` on texts written here and the window decision on a fixed ``NOW``.
"""

from datetime import UTC, datetime, timedelta

import pytest

from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.errors import InvalidAllowlist
from relayr.core.limits import Rate, parse_rate, turn_in_window, window_admits

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)

GOOD = """\
[rules."ops:incident-triage"]
turns = true

[limits.triage]
rules = ["ops:incident-triage"]
turns_per = "20/1m"
turns_in_flight = 2

[limits.acme]
rules = "*"
workspaces = ["acme/*"]
runs_in_flight = 8
tokens_per = "200000/1h"

[limits.chains]
rules = ["ops:*"]
chain_runs_per = "20/10m"
"""


def test_limits_are_parsed_in_file_order_with_their_lines() -> None:
    allowlists = parse_allowlist(GOOD)
    names = [(limit.name, limit.line) for limit in allowlists.limits]
    assert names == [("triage", 4), ("acme", 9), ("chains", 15)]
    triage = allowlists.limits[0]
    assert triage.turns_per == Rate(20, timedelta(minutes=1), "20/1m")
    assert triage.turns_in_flight == 2
    assert triage.runs_in_flight is None
    assert triage.workspaces == ("*/*",)
    assert allowlists.limits[1].rules == ("*",)


@pytest.mark.parametrize(
    ("rule", "workspace", "expected"),
    [
        ("ops:incident-triage", "acme/ops", ["triage", "acme", "chains"]),
        ("ops:incident-triage", "globex/ops", ["triage", "chains"]),
        ("ops:deploy-notice", "acme/ops", ["acme", "chains"]),
        ("billing:x", "globex/ops", []),
        ("ops:incident-triage-2", "globex/ops", ["chains"]),
    ],
)
def test_a_run_is_bound_by_every_limit_that_matches_its_rule_and_workspace(
    rule: str, workspace: str, expected: list[str]
) -> None:
    tenant, name = workspace.split("/")
    found = parse_allowlist(GOOD).limits_for(rule, tenant, name)
    assert [limit.name for limit in found] == expected


def test_explain_names_each_limit_that_may_bind_the_rule_and_its_line() -> None:
    data = parse_allowlist(GOOD).explain("ops:incident-triage").to_json()
    assert [(limit["key"], limit["line"]) for limit in data["limits"]] == [
        ("limits.triage", 4),
        ("limits.acme", 9),
        ("limits.chains", 15),
    ]
    assert data["limits"][0]["turns_per"] == "20/1m"
    assert data["limits"][1]["workspaces"] == ["acme/*"]


BAD_LIMITS: list[tuple[str, str, list[tuple[str, int | None]]]] = [
    (
        "a count that is not one",
        '[limits.a]\nrules = "*"\nturns_per = "20"\n',
        [("limits.a.turns_per", 3)],
    ),
    ("a zero count", '[limits.a]\nrules = "*"\nturns_per = "0/1m"\n', [("limits.a.turns_per", 3)]),
    (
        "a window too long",
        '[limits.a]\nrules = "*"\ntokens_per = "5/2d"\n',
        [("limits.a.tokens_per", 3)],
    ),
    (
        "in flight as a string",
        '[limits.a]\nrules = "*"\nruns_in_flight = "2"\n',
        [("limits.a.runs_in_flight", 3)],
    ),
    (
        "in flight of zero",
        '[limits.a]\nrules = "*"\nturns_in_flight = 0\n',
        [("limits.a.turns_in_flight", 3)],
    ),
    ("no rules", "[limits.a]\nruns_in_flight = 2\n", [("limits.a", 1)]),
    ("no bound", '[limits.a]\nrules = "*"\n', [("limits.a", 1)]),
    ("unknown key", '[limits.a]\nrules = "*"\nturn_per = "1/1m"\n', [("limits.a.turn_per", 3)]),
    (
        "malformed rule pattern",
        '[limits.a]\nrules = ["Ops X"]\nruns_in_flight = 1\n',
        [("limits.a.rules", 2)],
    ),
    (
        "malformed workspace",
        '[limits.a]\nrules = "*"\nworkspaces = ["acme"]\nruns_in_flight = 1\n',
        [("limits.a.workspaces", 3)],
    ),
    ("a limit outside an entry", "runs_in_flight = 2\n", [("runs_in_flight", 1)]),
    (
        "malformed name",
        '[limits."Big One"]\nrules = "*"\nruns_in_flight = 1\n',
        [('limits."Big One"', 1)],
    ),
]


@pytest.mark.parametrize(
    ("text", "expected"), [case[1:] for case in BAD_LIMITS], ids=[case[0] for case in BAD_LIMITS]
)
def test_a_bad_limit_refuses_the_whole_file_naming_its_line(
    text: str, expected: list[tuple[str, int | None]]
) -> None:
    good_grant = '[rules."ops:x"]\nturns = true\n'
    with pytest.raises(InvalidAllowlist) as refused:
        parse_allowlist(text + "\n" + good_grant)
    assert [(problem.key, problem.line) for problem in refused.value.problems] == expected


@pytest.mark.parametrize(
    ("text", "count", "window"),
    [
        ("20/1m", 20, 60),
        ("500/1h", 500, 3600),
        ("3/30s", 3, 30),
        ("1/d", 1, 86400),
        ("7 / 2m", 7, 120),
    ],
)
def test_rates(text: str, count: int, window: int) -> None:
    rate = parse_rate(text)
    assert (rate.count, rate.window) == (count, timedelta(seconds=window))


def test_a_sliding_window_admits_up_to_its_count_and_says_when_the_next_fits() -> None:
    rate = parse_rate("3/1m")
    used = [(NOW - timedelta(seconds=50), 1), (NOW - timedelta(seconds=20), 1), (NOW, 1)]
    assert window_admits(used, rate, 1, NOW) == (False, NOW + timedelta(seconds=10))
    assert window_admits(used[1:], rate, 1, NOW) == (True, None)
    later = NOW + timedelta(seconds=10, microseconds=1)
    assert window_admits(used, rate, 1, later) == (True, None)


def test_runs_waiting_on_a_window_each_expect_the_use_their_place_frees() -> None:
    rate = parse_rate("3/1m")
    used = [(NOW - timedelta(seconds=50), 1), (NOW - timedelta(seconds=20), 1), (NOW, 1)]
    expected = [
        NOW + timedelta(seconds=10),  # the first to wait takes the oldest use as it leaves
        NOW + timedelta(seconds=40),
        NOW + timedelta(minutes=1),
        NOW + timedelta(seconds=70),  # the fourth, the first one's again a window later
    ]
    assert [turn_in_window(used, rate, ahead, NOW) for ahead in range(4)] == expected
    assert turn_in_window(used[1:], rate, 5, NOW) is None  # one fits now: no wait
    # a limit lowered under what the window holds: the uses over it leave first
    assert turn_in_window(used, parse_rate("2/1m"), 0, NOW) == NOW + timedelta(seconds=40)


def test_a_window_of_tokens_waits_until_enough_has_left_it() -> None:
    rate = parse_rate("1000/1h")
    used = [(NOW - timedelta(minutes=50), 600), (NOW - timedelta(minutes=10), 500)]
    assert window_admits(used, rate, 1, NOW) == (False, NOW + timedelta(minutes=10))
