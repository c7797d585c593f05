"""An application's parts: what a command that runs no rule needs of it, and nothing more.

The ``RELAYR_APP`` factory may declare, with :func:`with_parts`, lighter factories of its two
sides: ``rules`` (a :class:`RulesPart`) and ``artifacts`` (an :class:`ArtifactsPart`), each
building its workspaces exactly as the whole factory does on its own library only.
:func:`opened_rules` and :func:`opened_artifacts` use a declared part and the whole factory
otherwise (ADR-0050). This module imports neither library at import.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from relayr.core.errors import InvalidApplication
from relayr.runtime.application import (
    Application,
    Factory,
    Library,
    create_engine,
    load_application,
    load_factory,
    migrate,
)
from relayr.settings import Settings

if TYPE_CHECKING:
    from artifactr import Workspaces as ArtifactWorkspaces
    from artifactr.workspace.storage import Storage as ArtifactStorage
    from reflexr.workspace import Storage as RuleStorage
    from reflexr.workspace import Workspaces as RuleWorkspaces
    from sqlalchemy.ext.asyncio import AsyncEngine

    from relayr.ledger.limits import LimitStore

PARTS_ATTRIBUTE: Final = "relayr_parts"
"""Where :func:`with_parts` keeps a factory's parts: an attribute of the factory function."""


class _Engines:
    """A part's engines, disposed of when the command is done."""

    engines: tuple[AsyncEngine, ...]

    async def aclose(self) -> None:
        for engine in self.engines:
            await engine.dispose()


@dataclass(frozen=True)
class RulesPart(_Engines):
    """reflexr's workspaces of an application, with its events and rules: no actions, no agent.

    Attributes:
        rules: reflexr's workspaces, built as the whole factory builds them.
        engines: The engines relayr disposes of when the command is done.
    """

    rules: RuleWorkspaces
    engines: tuple[AsyncEngine, ...] = ()


@dataclass(frozen=True)
class ArtifactsPart(_Engines):
    """artifactr's workspaces of an application, with its artifact types and hooks.

    Attributes:
        artifacts: artifactr's workspaces, built as the whole factory builds them.
        engines: The engines relayr disposes of when the command is done.
    """

    artifacts: ArtifactWorkspaces
    engines: tuple[AsyncEngine, ...] = ()


type RulesFactory = Callable[[Settings], Awaitable[RulesPart]]
type ArtifactsFactory = Callable[[Settings], Awaitable[ArtifactsPart]]


@dataclass(frozen=True)
class Parts:
    """The lighter factories a whole factory declared; None where it declared none."""

    rules: RulesFactory | None = None
    artifacts: ArtifactsFactory | None = None


def with_parts[F: Factory](
    *, rules: RulesFactory | None = None, artifacts: ArtifactsFactory | None = None
) -> Callable[[F], F]:
    """Declare the lighter factories of a whole application factory's two sides.

    Example::

        @with_parts(rules=create_rules, artifacts=create_artifacts)
        async def create_app(settings: Settings) -> Application: ...

    The factory is returned as it is (still an async function of the settings), carrying its
    parts in :data:`PARTS_ATTRIBUTE`.
    """

    def declare(factory: F) -> F:
        setattr(factory, PARTS_ATTRIBUTE, Parts(rules=rules, artifacts=artifacts))
        return factory

    return declare


def parts_of(factory: Factory) -> Parts:
    """The parts ``factory`` declared with :func:`with_parts` (none if it declared none)."""
    declared = getattr(factory, PARTS_ATTRIBUTE, None)
    return declared if isinstance(declared, Parts) else Parts()


@dataclass(frozen=True)
class LibraryStorage[S]:
    """One library's storage on the settings' database.

    Attributes:
        storage: The library's storage.
        engine: The database's engine, or None for in-memory storage.
    """

    storage: S
    engine: AsyncEngine | None

    @property
    def engines(self) -> tuple[AsyncEngine, ...]:
        return () if self.engine is None else (self.engine,)


async def open_rule_storage(settings: Settings) -> LibraryStorage[RuleStorage]:
    """Open reflexr's storage on ``settings.database_url``, its tables migrated; no artifactr.

    The same database and tables as :func:`relayr.runtime.application.open_storage`'s ``rules``.
    """
    if settings.database_url.startswith("memory://"):
        from reflexr.workspace import InMemoryStorage

        return LibraryStorage(InMemoryStorage(), None)
    from reflexr.sql import SqlStorage

    engine = await _migrated(settings, "reflexr")
    return LibraryStorage(SqlStorage(engine), engine)


async def open_artifact_storage(settings: Settings) -> LibraryStorage[ArtifactStorage]:
    """Open artifactr's storage on ``settings.database_url``, its tables migrated; no reflexr.

    The same database and tables as :func:`relayr.runtime.application.open_storage`'s ``artifacts``.
    """
    if settings.database_url.startswith("memory://"):
        from artifactr.workspace import InMemoryStorage

        return LibraryStorage(InMemoryStorage(), None)
    from artifactr.sql import SqlStorage

    engine = await _migrated(settings, "artifactr")
    return LibraryStorage(SqlStorage(engine), engine)


async def _migrated(settings: Settings, library: Library) -> AsyncEngine:
    engine = create_engine(settings.database_url, libraries=(library,))
    try:
        await migrate(engine, (library,))
    except BaseException:
        await engine.dispose()
        raise
    return engine


@asynccontextmanager
async def opened_rules(settings: Settings) -> AsyncIterator[RuleWorkspaces]:
    """reflexr's workspaces of ``settings.app``, for the block; closed after it.

    From the factory's declared ``rules`` part, or else from the whole application.

    Raises:
        InvalidApplication: If the factory cannot be loaded, or a part or the application it
            builds is not what it must be.
    """
    declared = parts_of(load_factory(settings.app)).rules
    opened = await _built(settings, "rules", declared, RulesPart)
    try:
        yield opened.rules
    finally:
        await opened.aclose()


@asynccontextmanager
async def opened_artifacts(settings: Settings) -> AsyncIterator[ArtifactWorkspaces]:
    """artifactr's workspaces of ``settings.app``, for the block; closed after it.

    From the factory's declared ``artifacts`` part, or else from the whole application.

    Raises:
        InvalidApplication: If the factory cannot be loaded, or a part or the application it
            builds is not what it must be.
    """
    declared = parts_of(load_factory(settings.app)).artifacts
    opened = await _built(settings, "artifacts", declared, ArtifactsPart)
    try:
        yield opened.artifacts
    finally:
        await opened.aclose()


async def _built[P: (RulesPart, ArtifactsPart)](
    settings: Settings,
    side: str,
    declared: Callable[[Settings], Awaitable[P]] | None,
    part: type[P],
) -> P | Application:
    """The ``declared`` part, checked to be a ``part``; the whole application if none is."""
    if declared is None:
        return await load_application(settings)
    built = await declared(settings)
    if not isinstance(built, part):
        raise InvalidApplication(
            f"application {settings.app!r}: its {side} part returned {type(built).__name__}, "
            f"not the {part.__name__} it must return"
        )
    return built


@asynccontextmanager
async def opened_limits(settings: Settings) -> AsyncIterator[tuple[RuleWorkspaces, LimitStore]]:
    """reflexr's workspaces of ``settings.app`` and the limits' counts in the same database
    (in memory, so empty, for an application without one), for the block; closed after it.

    Raises:
        InvalidApplication: As :func:`opened_rules`.
    """
    from relayr.ledger.limits import InMemoryLimitStore, SqlLimitStore

    declared = parts_of(load_factory(settings.app)).rules
    opened = await _built(settings, "rules", declared, RulesPart)
    store: LimitStore = SqlLimitStore(opened.engines[0]) if opened.engines else InMemoryLimitStore()
    try:
        yield opened.rules, store
    finally:
        await opened.aclose()
