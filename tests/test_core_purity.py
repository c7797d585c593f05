"""relayr's pure core imports no Celery, no storage and no artifactr/reflexr I/O layers."""

import ast
from pathlib import Path

import pytest

CORE = ["ids.py", "allowlist.py", "emissions.py", "errors.py"]
FORBIDDEN = (
    "celery",
    "kombu",
    "redis",
    "sqlalchemy",
    "asyncpg",
    "aiosqlite",
    "artifactr",
    "reflexr",
    "os",
    "datetime.datetime.now",
    "time",
    "relayr.settings",
)
ROOT = Path(__file__).resolve().parent.parent / "relayr"


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_nothing_of_the_shell(module: str) -> None:
    found = {
        name
        for name in imports(ROOT / module)
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)
    }
    # the allowlist file's reloader stats the file and times its checks: its only I/O
    allowed = {"time", "os"} if module == "allowlist.py" else set()
    assert found - allowed == set()


def test_only_settings_reads_the_environment() -> None:
    readers = [
        path.relative_to(ROOT).as_posix()
        for path in ROOT.rglob("*.py")
        if "os.environ" in path.read_text() or "getenv" in path.read_text()
    ]
    assert set(readers) <= {"settings.py"}
