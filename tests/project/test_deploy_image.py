"""deploy/Dockerfile's recipe, replayed in a fresh virtualenv: it installs relayr, which runs.

No container engine runs here: what the Dockerfile copies from the repository is copied to a
build context, its ``pip install`` runs in a new virtualenv of this Python (the image's 3.12),
and the entry point answers ``--help`` for its commands. Slow: it installs from scratch.
"""

import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.project.deploy_files import REPO, dockerfile_instructions, exec_form


def copied_sources() -> list[str]:
    """What the Dockerfile copies from the build context (the repository's root)."""
    sources: list[str] = []
    for keyword, arguments in dockerfile_instructions():
        if keyword == "COPY":
            assert not arguments.startswith("--from"), "a single-stage recipe"
            *paths, _ = shlex.split(arguments)
            sources.extend(paths)
    return sources


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.process
def test_the_image_recipe_installs_and_runs(tmp_path: Path) -> None:
    instructions = dockerfile_instructions()
    (base,) = [arguments for keyword, arguments in instructions if keyword == "FROM"]
    assert base == "python:3.12-slim"
    assert sys.version_info[:2] == (3, 12)
    context = tmp_path / "src"
    context.mkdir()
    for source in copied_sources():
        origin = REPO / source
        assert origin.exists(), f"the Dockerfile copies {source}, which is not in the repository"
        if origin.is_dir():
            shutil.copytree(
                origin, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(origin, context / source)
    (install,) = [
        arguments for keyword, arguments in instructions if keyword == "RUN" and "pip" in arguments
    ]
    pip_arguments = shlex.split(install.split("&&")[0])
    assert pip_arguments[:2] == ["pip", "install"]
    assert pip_arguments[-1] in (".", ".[otel]", ".[otel,console]")
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=True)
    python = environment / "bin" / "python"
    subprocess.run(
        [str(python), "-m", *pip_arguments[:-1], str(context) + pip_arguments[-1][1:]],
        check=True,
        capture_output=True,
        timeout=840,
    )
    entrypoint = exec_form(dict(instructions)["ENTRYPOINT"])
    assert entrypoint == ["relayr"]
    home = tmp_path / "home"
    home.mkdir()
    for argv in (["--help"], ["worker", "--help"], ["dispatch", "--help"], ["console", "--help"]):
        done = subprocess.run(
            [str(environment / "bin" / entrypoint[0]), *argv],
            cwd=home,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "Usage: relayr" in done.stdout
