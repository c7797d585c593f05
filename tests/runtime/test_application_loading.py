"""Loading the application: ``RELAYR_APP``'s factory found, called and its result checked
(``load_factory``, ``load_application``), and the ``Application`` it returns, frozen.

No services: the factories are a module of the test's own (some of them broken), written to
its temporary folder and imported from there.
"""

import dataclasses
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from relayr.core.errors import InvalidApplication
from relayr.runtime.application import Application, load_application, load_factory
from relayr.settings import Settings
from rules.example import create_app


@pytest.fixture
def factories(tmp_path: Path) -> Iterator[str]:
    """A module of application factories, some of them broken, importable as ``factories``."""
    (tmp_path / "factories.py").write_text(
        textwrap.dedent(
            """
            from reflexr import Rule, on, run
            from reflexr.workspace import InMemoryStorage, Workspaces
            from artifactr import Workspaces as ArtifactWorkspaces
            from artifactr.workspace import InMemoryStorage as ArtifactMemory
            from relayr.runtime.application import Application
            from rules.example import DeployFinished

            def not_async(settings):
                return None

            async def not_an_application(settings):
                return {"rules": []}

            async def missing_action(settings):
                rule = Rule(name="ops:orphan", when=on(DeployFinished), then=run("gone"))
                return Application(
                    artifacts=ArtifactWorkspaces(ArtifactMemory()),
                    rules=Workspaces(InMemoryStorage(), rules=[rule]),
                    actions={},
                )

            value = 42
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        yield "factories"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("factories", None)


def test_the_default_factory_is_the_example() -> None:
    assert load_factory(Settings().app) is create_app


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("rules.example", "name it as package.module:function"),
        ("no_such_package.mod:create_app", "cannot be imported: No module named"),
        ("rules.example:no_such_factory", "rules.example has no no_such_factory"),
        ("factories:value", "is not an async function of the settings"),
        ("factories:not_async", "is not an async function of the settings"),
    ],
)
def test_a_factory_that_cannot_be_loaded_is_named(
    factories: str, reference: str, message: str
) -> None:
    with pytest.raises(InvalidApplication, match=message) as refused:
        load_factory(reference)

    assert refused.value.code == "invalid_application"
    assert repr(reference) in refused.value.message


async def test_a_factory_must_return_an_application(factories: str) -> None:
    with pytest.raises(InvalidApplication, match="returned dict, not an Application"):
        await load_application(Settings(app="factories:not_an_application"))


async def test_rules_must_have_their_actions(factories: str) -> None:
    with pytest.raises(InvalidApplication, match="rule ops:orphan runs 'gone', which is not"):
        await load_application(Settings(app="factories:missing_action"))


def test_an_application_is_frozen() -> None:
    assert dataclasses.is_dataclass(Application)
    assert Application.__dataclass_params__.frozen  # type: ignore[attr-defined]
