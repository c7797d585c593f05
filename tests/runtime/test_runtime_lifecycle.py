"""A runtime's start and close (``Runtime.start``, ``aclose``): the allowlist a worker needs and
others do not, a worker without an agent, a holder of each runtime's own. On in-memory
storage, with the example application.
"""

import dataclasses
from pathlib import Path

import pytest

from relayr.core.errors import InvalidAllowlist
from relayr.runtime.process import Role, Runtime
from relayr.settings import Settings
from rules.example import create_app
from tests.example_runtime import settings_for


async def test_a_runtime_refuses_a_missing_allowlist(tmp_path: Path) -> None:
    settings = settings_for("memory://", tmp_path, allowlist=tmp_path / "nope.toml")

    with pytest.raises(InvalidAllowlist, match="cannot read: no such file"):
        await Runtime.start(settings, role="worker")


@pytest.mark.parametrize("role", ["cli", "dispatcher"])
async def test_only_a_worker_needs_the_allowlist(tmp_path: Path, role: Role) -> None:
    broken = tmp_path / "allowlist.toml"
    broken.write_text('[rules."ops:x"]\nturns = "yes"\n')
    runtime = await Runtime.start(settings_for("memory://", tmp_path, allowlist=broken), role=role)
    try:
        assert runtime.allowlist_file is None
        assert runtime.bridge.allowlists().for_rule("ops:x").turns is False
    finally:
        await runtime.aclose()


async def test_a_runtime_without_an_agent_starts_no_turns(tmp_path: Path) -> None:
    application = dataclasses.replace(
        await create_app(Settings(database_url="memory://")), agent=None
    )

    runtime = await Runtime.start(
        settings_for("memory://", tmp_path), role="worker", application=application
    )
    try:
        assert runtime.bridge.runner is None
        assert runtime.recovered == []
    finally:
        await runtime.aclose()
        await runtime.aclose()  # a second close does nothing


async def test_runtimes_have_their_own_holders(tmp_path: Path) -> None:
    settings = settings_for("memory://", tmp_path)
    first = await Runtime.start(settings, role="cli")
    second = await Runtime.start(settings, role="dispatcher")
    try:
        assert first.holder != second.holder
        assert first.holder.startswith("relayr-cli:")
        assert second.holder.startswith("relayr-dispatcher:")
    finally:
        await first.aclose()
        await second.aclose()
