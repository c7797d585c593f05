"""Live reload of the allowlist file: a changed file is in force at the next check, a bad or
removed one keeps the last good allowlist and is reported once per version.

On a real file in a temporary folder, saved with a moving mtime, and a clock the test moves.
"""

import logging
import os
from pathlib import Path

import pytest

from relayr.core.allowlist import Allowlists
from relayr.core.errors import InvalidAllowlist
from relayr.runtime.allowlist_file import AllowlistFile
from tests.allowlist_helpers import Clock


class Saves:
    """Writes the file as a later save: the mtime moves on even within one clock tick."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mtime_ns = 1_700_000_000_000_000_000

    def __call__(self, text: str) -> None:
        self.path.write_text(text)
        self.mtime_ns += 1_000_000_000
        os.utime(self.path, ns=(self.mtime_ns, self.mtime_ns))


GRANTED = '[rules."ops:x"]\nturns = true\n'
REVOKED = '[rules."ops:x"]\nturns = false\n'
BROKEN = '[rules."ops:x"]\nturns = "no"\nthreads = "all"\n'


@pytest.fixture
def save(tmp_path: Path) -> Saves:
    saves = Saves(tmp_path / "allowlist.toml")
    saves(GRANTED)
    return saves


class Reports:
    def __init__(self) -> None:
        self.invalid: list[InvalidAllowlist] = []
        self.reloaded: list[Allowlists] = []


def open_file(save: Saves, clock: Clock, reports: Reports) -> AllowlistFile:
    return AllowlistFile.open(
        save.path,
        clock=clock,
        on_invalid=reports.invalid.append,
        on_reload=reports.reloaded.append,
    )


def test_reloads_a_changed_file_at_the_next_check(save: Saves) -> None:
    clock, reports = Clock(), Reports()
    allowlist_file = open_file(save, clock, reports)
    assert allowlist_file.current().for_rule("ops:x").turns is True
    save(REVOKED)
    clock.now += 0.5
    assert allowlist_file.current().for_rule("ops:x").turns is True
    clock.now += 0.5
    assert allowlist_file.current().for_rule("ops:x").turns is False
    assert len(reports.reloaded) == 1
    clock.now += 5
    assert allowlist_file.current().for_rule("ops:x").turns is False
    assert len(reports.reloaded) == 1
    assert reports.invalid == []


def test_keeps_the_last_good_allowlist_and_reports_a_bad_version_once(save: Saves) -> None:
    clock, reports = Clock(), Reports()
    allowlist_file = open_file(save, clock, reports)
    good = allowlist_file.current()
    save(BROKEN)
    for _ in range(3):
        clock.now += 1
        assert allowlist_file.current() is good
    (error,) = reports.invalid
    assert [p.key for p in error.problems] == ['rules."ops:x".turns', 'rules."ops:x".threads']
    assert allowlist_file.last_error is error
    save(BROKEN + "# still broken\n")
    clock.now += 1
    assert allowlist_file.current() is good
    assert len(reports.invalid) == 2
    save(REVOKED)
    clock.now += 1
    assert allowlist_file.current().for_rule("ops:x").turns is False
    assert allowlist_file.last_error is None
    assert len(reports.reloaded) == 1


def test_a_removed_file_keeps_the_last_good_allowlist(save: Saves) -> None:
    clock, reports = Clock(), Reports()
    allowlist_file = open_file(save, clock, reports)
    save.path.unlink()
    clock.now += 1
    assert allowlist_file.current().for_rule("ops:x").turns is True
    clock.now += 1
    allowlist_file.current()
    (error,) = reports.invalid
    assert "no such file" in str(error)


def test_reload_checks_at_once(save: Saves) -> None:
    clock, reports = Clock(), Reports()
    allowlist_file = open_file(save, clock, reports)
    save(REVOKED)
    assert allowlist_file.current().for_rule("ops:x").turns is True
    assert allowlist_file.reload().for_rule("ops:x").turns is False
    assert allowlist_file.current().for_rule("ops:x").turns is False
    save(BROKEN)
    allowlist_file.reload()
    allowlist_file.reload()
    assert len(reports.invalid) == 2
    assert allowlist_file.current().for_rule("ops:x").turns is False


def test_the_default_report_logs_every_problem(
    save: Saves, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    allowlist_file = AllowlistFile(save.path, clock=clock, check_interval_s=0.25)
    save(BROKEN)
    clock.now += 0.25
    with caplog.at_level(logging.INFO, logger="relayr.allowlist"):
        allowlist_file.current()
        allowlist_file.current()
    (record,) = caplog.records
    assert record.name == "relayr.allowlist"
    assert record.levelno == logging.ERROR
    assert 'rules."ops:x".turns (line 2)' in record.getMessage()
    assert 'rules."ops:x".threads (line 3)' in record.getMessage()
    assert "last good" in record.getMessage()


@pytest.mark.parametrize("text", [None, BROKEN])
def test_an_unusable_file_at_start_is_an_error(tmp_path: Path, text: str | None) -> None:
    path = tmp_path / "allowlist.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(InvalidAllowlist) as raised:
        AllowlistFile.open(path)
    assert raised.value.source == str(path)
