"""The runtime: one per process, built on and used from one long-lived event loop (ADR-0004).

Open one :class:`Runtime` on the process's own loop (a worker: after it forks) and run every
task, pass and command on it, never ``asyncio.run`` per task. Opening builds the application
and the ledger and, with an agent, the Runner; a worker also loads the allowlist file and
recovers turns asked for and never taken. Closing always completes: running turns get
``turn_grace_s``, then everything is closed and disposed of, so no lock outlives the loop.
"""

import gc
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, Self

import structlog
from artifactr import SystemActor as ArtifactSystemActor
from artifactr.agent import RunHandle, Runner, TurnContext

from relayr.core.allowlist import Allowlists
from relayr.core.run_messages import RunMessage
from relayr.ledger import InMemoryLedger, Ledger, SqlLedger
from relayr.ledger.limits import InMemoryLimitStore, LimitStore, SqlLimitStore
from relayr.observe import observers
from relayr.runtime.allowlist_file import AllowlistFile
from relayr.runtime.application import Application, load_application
from relayr.runtime.bridge import Bridge
from relayr.settings import Settings

type Role = Literal["worker", "dispatcher", "cli", "demo"]

RECOVERY_ACTOR = ArtifactSystemActor(name="relayr")
"""Who lists and opens artifactr workspaces to recover their turns. ``Runner.recover`` acts as
the Runner itself, so this actor only needs to be allowed to open them."""

WORKSPACE_PAGE = 100
"""How many artifactr workspaces of a tenant are listed per call while recovering."""

logger = structlog.get_logger("relayr.runtime")


def freeze_start_up(role: Role | Literal["worker main"]) -> None:
    """Take what a long-running process has made so far (its modules, application, engines) out
    of the cyclic garbage collector's sight, once it has started (ADR-0129), and log how many
    objects that is. A full collection then walks only what the process made since: without
    this it held a dispatcher's loop, or a run's task, for 100 to 240 ms every few seconds
    under load. What starting left as garbage is collected first; the objects frozen are
    never collected, so call this once, from a process's own entry point, not from a test's."""
    gc.collect()
    gc.freeze()
    logger.info(
        "start-up objects frozen", role=role, pid=os.getpid(), objects=gc.get_freeze_count()
    )


def new_holder(role: Role) -> str:
    """A name for this process in reflexr's leases: unique per process and per runtime."""
    return f"relayr-{role}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class Runtime:
    """What one process runs with: settings, the application, the bridge and the lease holder.

    Build it with :meth:`start` inside the loop that will use it, and close it with
    :meth:`aclose` before that loop ends.

    Attributes:
        settings: The process's settings.
        application: The user's application, built in this loop.
        bridge: What runs act through; every run's ``Reaction.deps``.
        holder: This process's name in reflexr's leases.
        role: What the process is: a worker executes runs and recovers turns.
        recovered: The turns recovery started.
        executing: The runs this process is executing now, as (tenant, workspace, run) ids. Its
            executors share one lease holder, so a second delivery of a run to the same
            process must be told apart here, not by the lease.
        requeue: Hands runs to the queue from this process (a worker's, set by the task
            shell): runs a limit held back go as soon as it frees them. None: the
            dispatcher finds them due.
    """

    settings: Settings
    application: Application
    bridge: Bridge
    holder: str
    role: Role
    allowlist_file: AllowlistFile | None = None
    recovered: list[RunHandle] = field(default_factory=list)
    executing: set[tuple[str, str, str]] = field(default_factory=set)
    requeue: Callable[[RunMessage], Awaitable[None]] | None = None
    _closed: bool = False

    @classmethod
    async def start(
        cls,
        settings: Settings,
        *,
        role: Role,
        application: Application | None = None,
        allowlists: Callable[[], Allowlists] | None = None,
    ) -> Self:
        """Open the runtime of this process, in the running loop.

        Args:
            settings: The settings, read once by the caller.
            role: ``worker`` also recovers the turns that were asked for and never taken.
            application: An application already built in this loop, instead of the one
                ``settings.app`` names (tests, and programs that embed relayr).
            allowlists: Returns the allowlist in force, instead of ``settings.allowlist``
                (a worker's) or an empty one (any other role's).

        Raises:
            InvalidAllowlist: If a worker's allowlist file is missing or invalid.
            InvalidApplication: If the application cannot be built.
        """
        observers.install()
        allowlist_file = None
        if allowlists is None and role == "worker":
            allowlist_file = AllowlistFile.open(settings.allowlist)
            allowlists = allowlist_file.current
        elif allowlists is None:
            nothing = Allowlists.empty("<not a worker: no rule acts here>")
            allowlists = lambda: nothing  # noqa: E731
        if application is None:
            application = await load_application(settings)
        else:
            application.check()
        try:
            ledger = await _open_ledger(application)
            runner = (
                None
                if application.agent is None
                else Runner(
                    application.agent,
                    app=application.app_deps,
                    turn_context=_traced_turns(settings, ledger),
                )
            )
        except BaseException:
            await application.aclose()
            raise
        bridge = Bridge(
            artifacts=application.artifacts,
            ledger=ledger,
            allowlists=allowlists,
            runner=runner,
            clock=application.rules.clock,
            app=application.app_deps,
            limits=_open_limits(application),
        )
        runtime = cls(
            settings=settings,
            application=application,
            bridge=bridge,
            holder=new_holder(role),
            role=role,
            allowlist_file=allowlist_file,
        )
        if role == "worker":
            try:
                runtime.recovered = await runtime.recover()
            except BaseException:
                await runtime.aclose()
                raise
        logger.info(
            "runtime started",
            role=role,
            holder=runtime.holder,
            agent=runner is not None,
            recovered=len(runtime.recovered),
        )
        return runtime

    async def recover(self) -> list[RunHandle]:
        """Start the turns every known workspace was asked for and never took.

        The workspaces are those of the tenants reflexr knows: relayr acts only where a rule
        ran. Turns it starts are tracked like those runs start, for the shutdown grace.
        """
        runner = self.bridge.runner
        if runner is None:
            return []
        known = await self.application.rules.storage.workspaces()
        tenants = sorted({ref.tenant_id for ref in known})
        started: list[RunHandle] = []
        for tenant in tenants:
            after: str | None = None
            while True:
                page = await self.application.artifacts.list(
                    tenant, actor=RECOVERY_ACTOR, after=after, limit=WORKSPACE_PAGE
                )
                for workspace_id in page:
                    handle = await self.application.artifacts.open(
                        tenant, workspace_id, actor=RECOVERY_ACTOR
                    )
                    for turn in await runner.recover(handle):
                        self.bridge.turns.started(turn)
                        started.append(turn)
                if len(page) < WORKSPACE_PAGE:
                    break
                after = page[-1]
        return started

    async def aclose(self) -> None:
        """Give running turns the grace period, then stop them and release every connection.

        Safe to call twice; the second call does nothing.
        """
        if self._closed:
            return
        self._closed = True
        try:
            running, asking = await self._grace(self.settings.turn_grace_s)
            if running or asking:
                logger.warning(
                    "turns still running after the grace period", turns=running, asking=asking
                )
            if self.bridge.runner is not None:
                await self.bridge.runner.aclose()
                await self.bridge.turns.aclose()
            await self.bridge.ledger.aclose()
        finally:
            await self.application.aclose()
        logger.info("runtime closed", role=self.role, holder=self.holder)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def _grace(self, grace_s: float) -> tuple[int, int]:
        """Wait up to ``grace_s`` for this process's turns, the turns they hand their threads
        over to, and the turns being asked for again (one that failed to start); how many are
        still running, and how many still being asked for again."""
        if self.bridge.runner is None:
            return 0, 0
        return await self.bridge.turns.settled(grace_s)


def _traced_turns(settings: Settings, ledger: Ledger) -> TurnContext | None:
    """With tracing on, a span in the sending run's trace that follows each turn to its end
    (:func:`relayr.observe.otel.turn_context`, ADR-0080); else nothing, at no cost per turn."""
    if not settings.tracing:
        return None
    from relayr.observe.otel import turn_context  # the SDK: only when tracing is on

    return turn_context(ledger)


def _open_limits(application: Application) -> LimitStore:
    """The limits' counts in the application's first engine's database, else in memory."""
    if application.engines:
        return SqlLimitStore(application.engines[0])
    return InMemoryLimitStore()


async def _open_ledger(application: Application) -> Ledger:
    """The application's ledger, else one in its first engine's database, else in memory."""
    if application.ledger is not None:
        return application.ledger
    if application.engines:
        return await SqlLedger.open(application.engines[0])
    return InMemoryLedger()
