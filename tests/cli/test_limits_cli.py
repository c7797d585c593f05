"""``relayr allowlist explain`` names a rule's limits with their lines; ``relayr limits``
shows each limit's use, and refuses a bad file whole (exit code 2), naming the limit's line.

The use itself, on real workers, is read in tests/execution/test_limits_worker.py.
"""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from relayr.cli import cli
from tests.workers import relayr_environment

ALLOWLIST = """
[rules."ops:incident-triage"]
turns = true

[limits.triage]
rules = ["ops:incident-triage"]
turns_per = "20/1m"
turns_in_flight = 2
"""


@pytest.fixture
def environment(tmp_path: Path) -> dict[str, str]:
    allowlist = tmp_path / "allowlist.toml"
    allowlist.write_text(ALLOWLIST)
    return relayr_environment(tmp_path, allowlist=allowlist)


def invoke(environment: dict[str, str], *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env=environment, catch_exceptions=False)


def test_explain_shows_each_limit_and_where_it_comes_from(environment: dict[str, str]) -> None:
    result = invoke(environment, "allowlist", "explain", "ops:incident-triage")
    assert result.exit_code == 0, result.output
    assert "limit limits.triage (line 5) in */*: turns_in_flight = 2, turns_per = 20/1m" in (
        result.output
    )
    other = invoke(environment, "allowlist", "explain", "ops:deploy-notice")
    assert "limits: none" in other.output


def test_limits_shows_each_bound_unused_before_any_run(environment: dict[str, str]) -> None:
    result = invoke(environment, "limits", "--json")
    assert result.exit_code == 0, result.output
    uses = json.loads(result.output)
    assert [(use["kind"], use["bound"], use["used"], use["waiting"]) for use in uses] == [
        ("turns_in_flight", "2", 0, 0),
        ("turns_per", "20/1m", 0, 0),
    ]
    assert {use["line"] for use in uses} == {5}


def test_a_bad_limit_is_refused_whole_naming_its_line(
    environment: dict[str, str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(ALLOWLIST.replace('"20/1m"', '"20 a minute"'))
    result = invoke(environment, "limits", "--file", str(bad))
    assert result.exit_code == 2
    assert "limits.triage.turns_per (line 7)" in result.stderr
    check = invoke(environment, "allowlist", "check", str(bad))
    assert check.exit_code == 1
    assert "limits.triage.turns_per (line 7)" in check.stderr
