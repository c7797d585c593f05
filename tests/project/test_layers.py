"""The layers hold: the contracts in pyproject.toml's ``[tool.importlinter]`` are kept, and
``lint-imports`` (run by ``make check``) fails when one is broken.

The contracts themselves are the check; these tests make sure the tool runs on this tree and
that it really refuses a forbidden import, on a temporary copy of the repository with one added.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("relayr", "tasks", "rules", "bench", "tests")
TIMEOUT_S = 120


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The repository's packages and pyproject.toml, without caches."""
    for package in PACKAGES:
        shutil.copytree(
            REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_import(path: Path, line: str) -> None:
    text = path.read_text()
    path.write_text(
        f"{line}\n{text}" if not text.startswith('"""') else _after_docstring(text, line)
    )


def _after_docstring(text: str, line: str) -> str:
    end = text.index('"""', 3) + 3
    return f"{text[:end]}\n{line}\n{text[end:]}"


@pytest.mark.process
def test_the_tree_keeps_every_contract() -> None:
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("relayr/core/ids.py", "import sqlalchemy", "relayr.core imports no I/O"),
        ("relayr/core/emissions.py", "import time", "relayr.core imports no I/O"),
        ("relayr/core/routing.py", "import os", "relayr.core imports no I/O"),
        ("relayr/core/allowlist.py", "import artifactr.sql", "relayr.core imports no I/O"),
        ("relayr/core/reasons.py", "import relayr.observe.metrics", "relayr.core imports no I/O"),
        ("relayr/execution/executor.py", "import tasks.runs", "Nothing in relayr but relayr.cli"),
        ("relayr/ops/runs.py", "import relayr.cli.helpers", "Only relayr.cli itself"),
        ("relayr/core/errors.py", "import relayr.core.allowlist", "No cycles"),
        ("relayr/runtime/bridge.py", "import relayr.execution.writes", "layered by stage"),
        ("relayr/observe/metrics.py", "import relayr.runtime.process", "layered by stage"),
        ("relayr/dispatch/evaluation.py", "import relayr.ops.rows", "layered by stage"),
        ("relayr/settings.py", "import relayr.ledger.port", "layered by stage"),
        ("relayr/execution/writes.py", "import relayr.observe.metrics", "The path emits facts"),
        ("relayr/migrations/__init__.py", "import relayr.ledger.sql", "layered by stage"),
        ("relayr/runtime/process.py", "import tqdm", "Only the console and relayr publish"),
        ("relayr/execution/executor.py", "import starlette", "Only the console and relayr publish"),
    ],
)
@pytest.mark.process
def test_a_forbidden_import_breaks_make_check(
    copy: Path, module: str, line: str, contract: str
) -> None:
    add_import(copy / module, line)

    done = lint_imports(copy)

    assert done.returncode != 0
    broken = done.stdout[done.stdout.index("Broken contracts") :]
    assert contract in broken


def test_only_settings_reads_the_environment() -> None:
    root = REPO / "relayr"
    readers = [
        path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        if "os.environ" in path.read_text() or "getenv" in path.read_text()
    ]
    assert set(readers) <= {"settings.py"}
