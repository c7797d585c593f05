"""How a run's writes reach artifactr: one workspace handle, commits that carry their ledger
rows, and every failure turned into the attempt's ``RunFailure`` with a stable reason.

:class:`relayr.execution.actions.RunActions` decides with the core (:mod:`relayr.core.routing`) and
writes through :class:`Writes`. Every storage call here is retried on a transient fault
(:mod:`relayr.runtime.transient`; the ids are derived, so a repeat is made once); what artifactr
refuses is classified by :func:`relayr.core.refusals.classify`; a storage error that outlasts the
retries fails the attempt ``storage_unavailable`` (retried by the rule's policy) with a message
naming the write, never as a raw SQLAlchemy error.
"""

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import structlog
from artifactr import Artifact, ExternalAgentActor, VersionConflict, Versioned, Workspace
from artifactr.agent import Runner, Sent
from artifactr.core import (
    Command,
    InvalidState,
    MessagePosted,
    NotFound,
    Outcome,
    Rejection,
    Thread,
)
from artifactr.workspace import ThreadBusy
from reflexr.core import Run
from reflexr.workspace import RunFailure

from relayr.core import reasons
from relayr.core.emissions import EmissionKind, EmissionOutcome, EmissionPolicy, EmissionRecord
from relayr.core.errors import InvalidEmission
from relayr.core.refusals import Refusal, classify, record_failure, storage_failure
from relayr.ledger.port import MADE_WITH_THEIR_WRITE, Cause, LedgerWrites, WorkspaceKey, WriteKind
from relayr.observe import hooks
from relayr.observe.hooks import EmissionMade, WriteRefused
from relayr.runtime.bridge import Bridge
from relayr.runtime.transient import is_storage_error, retried

logger = structlog.get_logger("relayr.actions")

READ_PAGE: Final = 500
"""How many envelopes of a thread one read takes while looking for a message by id."""


def failure(refusal: Refusal) -> RunFailure:
    """A refusal as the attempt's failure: reflexr's retry policy decides what follows."""
    return RunFailure(refusal.message, reason=refusal.reason, permanent=refusal.permanent)


class Writes:
    """The artifactr side of one attempt: its workspace, as the rule's participant."""

    def __init__(
        self,
        bridge: Bridge,
        workspace: WorkspaceKey,
        actor: ExternalAgentActor,
        cause: Cause,
        log: Any,
    ) -> None:
        self._bridge = bridge
        self.workspace = workspace
        self._actor = actor
        self._cause = cause
        self._log = log
        self._handle: Workspace | None = None
        self.pending = LedgerWrites()
        """What the run's completion commits: rows known only after their write."""

    async def handle(self) -> Workspace:
        """The run's workspace, opened once per attempt as the rule's participant."""
        if self._handle is None:
            tenant, workspace = self.workspace.tenant_id, self.workspace.workspace_id
            self._handle = await self.guarded(
                f"opening workspace {self.workspace}",
                lambda: self._bridge.artifacts.open(tenant, workspace, actor=self._actor),
            )
        return self._handle

    async def guarded[T](
        self,
        doing: str,
        step: Callable[[], Awaitable[T]],
        *,
        expected: tuple[type[Rejection], ...] = (),
    ) -> T:
        """Run a storage step, retried on transient faults; fail the attempt on the rest.

        artifactr's refusals are classified (:func:`relayr.core.refusals.classify`), each with
        a named reason, except those the caller reads itself (``expected``: a used id's
        ``InvalidState``, a ``VersionConflict`` it re-reads). A storage error that outlasts the
        retries is ``storage_unavailable``.
        """
        try:
            return await retried(step)
        except ThreadBusy as busy:
            if ThreadBusy in expected:
                raise
            raise self.refused_by_artifactr(busy, doing) from None
        except Rejection as refused:
            if isinstance(refused, expected):
                raise
            raise self.refused_by_artifactr(refused, doing) from None
        except Exception as error:
            if not is_storage_error(error):
                raise
            refusal = storage_failure(error, doing=doing)
            self._log.warning("write failed: storage unavailable", doing=doing, error=str(error))
            raise failure(refusal) from None

    def refused_by_artifactr(self, refused: Rejection, doing: str) -> RunFailure:
        """artifactr's refusal as the attempt's failure, with a reason from the one list."""
        code = reasons.THREAD_BUSY if isinstance(refused, ThreadBusy) else refused.code
        entity = refused.entity if isinstance(refused, NotFound) else None
        refusal = classify(code, refused.message, doing=doing, entity=entity)
        if refusal.permanent:
            hooks.emit(WriteRefused(refusal.reason))
        self._log.warning(
            "write refused by artifactr",
            doing=doing,
            reason=refusal.reason,
            retried=not refusal.permanent,
        )
        return failure(refusal)

    def refused(self, refusal: Refusal, operation: str, **where: str) -> RunFailure:
        """relayr's own refusal, before anything is written: logged and counted."""
        self._log.warning(
            "write refused",
            refused=operation,
            reason=refusal.reason,
            detail=refusal.message,
            **where,
        )
        hooks.emit(WriteRefused(refusal.reason))
        return failure(refusal)

    async def commit(
        self,
        command: Command,
        keys: Sequence[tuple[WriteKind, str]],
        record: EmissionRecord | None = None,
        *,
        doing: str,
    ) -> Outcome:
        """Commit ``command``; the write's cause, under each of ``keys``, (and ``record``) ride
        in its transaction. Returns what artifactr made of it: an artifact change sent directly
        may come back ``Proposed``, which the caller reports as the proposal it is.

        A transient storage fault is retried: the command's id is derived, so a commit that
        did land is refused as used (``InvalidState``) the second time. When the commit is
        refused, the cause under a key derived from the run waits for the run's completion (an
        earlier attempt made the write, or none will, and a cause without its write is
        harmless). A revision's does not: another run may make that revision (ADR-0065); nor
        does an edit's, which says the edit was made (ADR-0102).
        """
        handle = await self.handle()
        writes = LedgerWrites()
        for kind, key in keys:
            writes.cause(self.workspace, kind, key, self._cause)
        if record is not None:
            writes.emission(record)

        async def step() -> Outcome:
            async with self._bridge.ledger.alongside(writes):
                return await handle.commit(command)

        try:
            return await self.guarded(doing, step, expected=(InvalidState, VersionConflict))
        except BaseException:
            if not writes.committed:
                for kind, key in keys:
                    if kind not in MADE_WITH_THEIR_WRITE:
                        self.pending.cause(self.workspace, kind, key, self._cause)
            raise

    async def made(self, kind: WriteKind, key: str) -> bool:
        """Whether this run's write found by ``key`` was made: its row, which rides only the
        write (:data:`~relayr.ledger.port.MADE_WITH_THEIR_WRITE`), is in the ledger."""
        ledger = self._bridge.ledger
        found = await self.guarded(
            f"reading the ledger for {kind} {key}",
            lambda: ledger.cause(self.workspace, kind, key),
        )
        return found is not None and found.run_id == self._cause.run_id

    async def record_cause(self, kind: WriteKind, key: str) -> None:
        """Commit the cause of a write before the write (a send, which starts a turn)."""
        ledger = self._bridge.ledger
        await self.guarded(
            f"recording the cause of {kind} {key}",
            lambda: ledger.record_cause(self.workspace, kind, key, self._cause),
        )

    async def send(
        self, runner: Runner[Any], thread_id: str, content: str, record: EmissionRecord
    ) -> Sent:
        """``Runner.send`` the message ``record`` names, the record riding its commit.

        The record commits in the message's transaction, or not at all (ADR-0103): a send that
        exists has its record, whatever becomes of the run afterwards.

        Raises:
            InvalidState: If the message id is used (an earlier attempt posted it).
        """
        handle = await self.handle()
        writes = LedgerWrites()
        writes.emission(record)
        ledger = self._bridge.ledger

        async def step() -> Sent:
            async with ledger.alongside(writes):
                return await runner.send(handle, thread_id, content, message_id=record.message_id)

        return await self.guarded(
            f"sending message {record.message_id}", step, expected=(InvalidState,)
        )

    async def write_record(self, record: EmissionRecord) -> None:
        """Write the record of an emission that rode no write of its own (an earlier attempt's
        write found, a turn asked for), at once, in a transaction of its own.

        Raises:
            RunFailure: ``io_error`` (retried) when the ledger keeps failing: the write is in
                artifactr, and the retry finds it and records it.
        """
        writes = LedgerWrites()
        writes.emission(record)
        ledger = self._bridge.ledger
        try:
            await retried(lambda: ledger.write(writes))
        except Exception as error:
            if not is_storage_error(error):
                raise
            doing = f"recording the {record.outcome} {record.kind} {record.message_id}"
            refusal = record_failure(error, doing=doing)
            self._log.warning(
                "emission record not written", doing=doing, reason=refusal.reason, error=str(error)
            )
            hooks.emit(WriteRefused(refusal.reason))
            raise failure(refusal) from None

    async def held_kind(self, thread_id: str, message_id: str) -> EmissionKind | None:
        """What artifactr holds under a used message id: a ``notice`` or a ``message``.

        Read back only when an id turns out used (a retried attempt), so that its emission
        record says what artifactr holds, whatever the allowlist says now. Found in the ledger:
        every notice and send leaves its record with its write, and a record's kind is what
        artifactr holds (ADR-0103). Only a message sent before records rode their sends (or by
        a ledger on an engine of its own, whose process died between the two) has none: its
        thread is read for it then. None if the id is not in the thread either.
        """
        ledger = self._bridge.ledger
        run_id = self._cause.run_id
        records = await self.guarded(
            f"reading the emission records of run {run_id}",
            lambda: ledger.emissions(self.workspace, run_id),
        )
        for record in records:
            if record.message_id == message_id:
                return record.kind
        self._log.info("emission record missing: reading the thread", message_id=message_id)
        return await self._held_in_thread(thread_id, message_id)

    async def _held_in_thread(self, thread_id: str, message_id: str) -> EmissionKind | None:
        """What a thread's log holds under ``message_id``, read page by page."""
        handle = await self.handle()
        after = 0
        while True:
            page = await self.guarded(
                f"reading thread {thread_id}",
                lambda after=after: handle.read(  # type: ignore[misc]
                    after_seq=after, threads={thread_id}, limit=READ_PAGE
                ),
            )
            for envelope in page:
                event = envelope.event
                if isinstance(event, MessagePosted) and event.message_id == message_id:
                    return "notice" if event.kind == "notice" else "message"
            if len(page) < READ_PAGE:
                return None
            after = page[-1].seq

    async def thread(self, thread_id: str) -> Thread:
        """The thread as it is now (its mode); refused ``thread_not_found`` if there is none,
        which also checks a thread a proposal names, which artifactr does not check."""
        handle = await self.handle()
        return await self.guarded(f"reading thread {thread_id}", lambda: handle.thread(thread_id))

    async def artifact(self, artifact_id: str) -> Versioned[Artifact]:
        """The artifact as it is now, archived or not; refused ``not_found`` if there is none."""
        handle = await self.handle()
        return await self.guarded(
            f"reading artifact {artifact_id}", lambda: handle.artifact(artifact_id)
        )

    async def artifact_or_none(self, artifact_id: str) -> Versioned[Artifact] | None:
        """The artifact as it is now, or None if there is none."""
        handle = await self.handle()

        async def read() -> Versioned[Artifact] | None:
            try:
                return await handle.artifact(artifact_id)
            except NotFound:
                return None

        return await self.guarded(f"reading artifact {artifact_id}", read)

    async def proposal_exists(self, proposal_id: str) -> bool:
        """Whether the proposal ``proposal_id`` exists (an earlier attempt, or this one's write
        that artifactr turned into a proposal, made it)."""
        handle = await self.handle()

        async def read() -> bool:
            try:
                await handle.proposal(proposal_id)
            except NotFound:
                return False
            return True

        return await self.guarded(f"reading proposal {proposal_id}", read)

    def record(
        self,
        run: Run,
        kind: EmissionKind,
        outcome: EmissionOutcome,
        thread: str,
        message_id: str,
        content: str,
        *,
        policy: EmissionPolicy,
    ) -> EmissionRecord:
        """The emission record of ``run``'s notice or message (``kind``: what artifactr holds)
        on the route the allowlist decided (``policy``: ``notice`` or ``turn``).

        Built, so validated, before the write it records is made (ADR-0105).

        Raises:
            RunFailure: ``invalid_emission`` (permanent), naming the record's code, if it does
                not validate: nothing is written.
        """
        try:
            return EmissionRecord(
                kind=kind,
                rule=run.rule,
                run_id=run.id,
                attempt=run.attempts,
                epoch=run.epoch,
                tenant_id=self.workspace.tenant_id,
                workspace_id=self.workspace.workspace_id,
                thread_id=thread,
                message_id=message_id,
                policy=policy,
                outcome=outcome,
                content=content,
                emitted_at=self._bridge.clock(),
            )
        except InvalidEmission as invalid:
            refusal = Refusal(
                reasons.INVALID_EMISSION,
                f"the record of {kind} {message_id} of run {run.id} is refused, "
                f"{invalid.code}: {invalid.message}",
            )
            raise self.refused(refusal, kind, thread_id=thread) from None

    def emitted(self, record: EmissionRecord, *, turn: str | None = None) -> None:
        """Count and log one emission, and say what it did on the write's span."""
        hooks.emit(EmissionMade(record.kind, record.outcome, record.policy, turn))
        self._log.info(
            "emission",
            kind=record.kind,
            policy=record.policy,
            outcome=record.outcome,
            thread_id=record.thread_id,
            message_id=record.message_id,
            turn_id=turn,
        )
