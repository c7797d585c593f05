"""Loading the allowlist file from disk: what cannot be read is named as such.

On real files in a temporary folder (a missing one, a directory, Latin-1, one without read
permission, read in a process without the capabilities that bypass a file's mode), and the
example application's ``rules/allowlist.toml``.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from relayr.core.allowlist import MOST_RESTRICTIVE, Allowlist, GrantSource, warnings
from relayr.core.errors import InvalidAllowlist
from relayr.runtime.allowlist_file import load_allowlist

REPO = Path(__file__).resolve().parents[2]


def test_load_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "allowlist.toml"
    path.write_bytes(b'\xef\xbb\xbf[rules."ops:x"]\nturns = true\n')
    allowlists = load_allowlist(path)
    assert allowlists.source == str(path)
    assert allowlists.for_rule("ops:x").turns is True


def test_unreadable_files(tmp_path: Path) -> None:
    cases: list[tuple[Path, str, int | None]] = []
    cases.append((tmp_path / "missing.toml", "no such file", None))
    cases.append((tmp_path, "directory", None))
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'[rules."ops:x"]\n# caf\xe9\n')
    cases.append((latin, "not utf-8", 2))
    for path, message, line in cases:
        with pytest.raises(InvalidAllowlist) as raised:
            load_allowlist(path)
        (problem,) = raised.value.problems
        assert problem.key == "<file>"
        assert message in problem.message
        assert problem.line == line
        assert raised.value.source == str(path)


@pytest.mark.process
def test_unreadable_for_permissions(tmp_path: Path) -> None:
    """A file the worker may not read is refused as such ("permission denied"), not as a
    missing or invalid one.

    Root reads any file, whatever its mode, and CI runs as root: there the load runs in a
    process that stays root but without the capabilities that bypass a file's mode
    (``CAP_DAC_OVERRIDE``, ``CAP_DAC_READ_SEARCH``), so the mode applies to it as to anyone.
    """
    path = tmp_path / "locked.toml"
    path.write_text("[default]\n")
    path.chmod(0)
    try:
        if os.access(path, os.R_OK):
            problems = load_without_privileges(path)
        else:
            with pytest.raises(InvalidAllowlist) as raised:
                load_allowlist(path)
            problems = [problem.message for problem in raised.value.problems]
    finally:
        path.chmod(0o600)
    assert problems == ["cannot read: permission denied"]


UNPRIVILEGED_LOAD = """
import json, os, sys
from relayr.runtime.allowlist_file import load_allowlist
from relayr.core.errors import InvalidAllowlist
assert not os.access(sys.argv[1], os.R_OK), "the file is still readable: privileges kept"
try:
    load_allowlist(sys.argv[1])
except InvalidAllowlist as invalid:
    print(json.dumps([problem.message for problem in invalid.problems]))
else:
    print("[]")
"""


def load_without_privileges(path: Path) -> list[str]:
    """The problems ``load_allowlist(path)`` raises in a process without the capabilities that
    read any file (dropped from its bounding set by util-linux's ``setpriv``)."""
    setpriv = shutil.which("setpriv")
    command = [
        str(setpriv),
        "--bounding-set=-dac_override,-dac_read_search",
        sys.executable,
        "-c",
        UNPRIVILEGED_LOAD,
        str(path),
    ]
    done = None if setpriv is None else subprocess.run(command, capture_output=True, text=True)
    if done is None or done.returncode != 0:
        why = "setpriv is missing" if done is None else done.stderr.strip()
        message = f"cannot drop the privileges that read any file: {why}"
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (CI=true: this test may not skip)")
        pytest.skip(message)
    problems: list[str] = json.loads(done.stdout)
    return problems


def test_the_example_application_file() -> None:
    allowlists = load_allowlist(REPO / "rules" / "allowlist.toml")
    assert set(allowlists.rules) == {"ops:incident-triage"}
    assert allowlists.for_rule("ops:incident-triage") == Allowlist(turns=True)
    assert allowlists.for_rule("ops:other") == MOST_RESTRICTIVE
    assert allowlists.explain("ops:other").entry == GrantSource("default", "default")
    assert allowlists.default is not None
    assert allowlists.default.threads == "chain"
    assert warnings(allowlists, ["ops:incident-triage", "ops:other"]) == []
