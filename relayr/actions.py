"""RunActions: a rule's run acting in artifactr as its rule's own participant.

Each run acts as ``ExternalAgentActor(client_id="reflexr:<rule>", name=<rule>)``, in its own
tenant and workspace only, and every write it makes has an id derived from the run
(:mod:`relayr.ids`). So a retried attempt (a Celery redelivery, reflexr's retry policy, an
operator's retry) makes each effect once:

- a notice whose id is used was posted by an earlier attempt: done, not an error;
- a send whose id is used committed its message in an earlier attempt, which may have died
  before it asked for the turn: it asks now (ADR-0026), which starts that turn or does nothing.

Rules post notices by default. A message that starts an agent turn needs the operators'
allowlist to grant ``turns``, checked when the run acts, not when it was queued, so a revoked
grant stops the next send of a run already queued. ``post`` lets the allowlist pick the route.

The run behind each write is recorded in the ledger under the write's id, and each notice or
send leaves one emission record (ADR-0023). Before a send, which starts a turn, the cause is
committed first, on its own. Any other write's cause, and a notice's record, ride in the
write's own transaction (:meth:`relayr.ledger.Ledger.alongside`), so a write that exists always
has them. What an action learns only after its write (a send's outcome, a notice an earlier
attempt posted) waits in :func:`pending_writes` for the run's completion, whose transaction
carries it. Transient storage faults are retried inside each write (:mod:`relayr.transient`):
the ids are derived, so a repeat is made once.

Refusals are reflexr ``RunFailure``s, so the rule's retry policy decides what follows: a
permission refused is permanent (``not_allowed``); artifactr's ``validation_failed``,
``patch_failed`` and ``not_found`` are retried; its other refusals are permanent.
"""

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Final
from weakref import WeakKeyDictionary

import structlog
from artifactr import Artifact, ExternalAgentActor, JsonPatch, VersionConflict, Workspace
from artifactr.core import (
    ArchiveArtifact,
    Command,
    CreateArtifact,
    CreateThread,
    EditArtifact,
    InvalidState,
    PostMessage,
    ProposeChange,
    Rejection,
    create_artifact,
)
from artifactr.workspace import ThreadBusy
from reflexr.workspace import Reaction, RunFailure

from relayr import metrics
from relayr.allowlist import Allowlist
from relayr.bridge import Bridge
from relayr.emissions import EmissionKind, EmissionRecord, Outcome, Policy
from relayr.ids import IdDeriver, digest
from relayr.ledger.port import Cause, LedgerWrites, WorkspaceKey, WriteKind
from relayr.transient import retried

logger = structlog.get_logger("relayr.actions")

RETRIED_REJECTIONS: Final = frozenset({"validation_failed", "patch_failed", "not_found"})
"""artifactr's refusals that a later attempt may not meet: the data, the artifact or the
thread may be fixed or appear meanwhile. Any other refusal is permanent."""

EDIT_CONFLICT_TRIES: Final = 5
"""How often an edit re-reads its artifact after a version conflict before it fails the
attempt (retried): enough for a busy artifact, bounded so a hot one cannot hold a worker."""

NO_THREAD: Final = "no_thread"
NOT_ALLOWED: Final = "not_allowed"
EMPTY_CONTENT: Final = "empty_content"
INVALID_CONTENT: Final = "invalid_content"
INVALID_ID: Final = "invalid_id"


class NotAllowed(RunFailure):
    """Raised when the allowlist does not let the rule make a write; permanent, nothing written."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason=NOT_ALLOWED, permanent=True)


_acting: WeakKeyDictionary[Reaction[Any], "RunActions"] = WeakKeyDictionary()


def acting(reaction: Reaction[Any]) -> "RunActions":
    """Return the RunActions of this attempt: the one call an action makes to act in artifactr.

    The same reaction always gets the same RunActions, so the ids of its writes are counted
    across the whole attempt however often the action asks.

    Raises:
        TypeError: If the reaction's ``deps`` is not a :class:`~relayr.bridge.Bridge`: the run
            is not executed by relayr.
    """
    actions = _acting.get(reaction)
    if actions is None:
        if not isinstance(reaction.deps, Bridge):
            raise TypeError(
                f"run {reaction.run_id} is not executed by relayr: its deps are not a Bridge"
            )
        actions = _acting[reaction] = RunActions(reaction.deps, reaction)
    return actions


def pending_writes(reaction: Reaction[Any]) -> LedgerWrites | None:
    """The ledger rows this attempt's actions left for the run's completion to commit, if any."""
    actions = _acting.get(reaction)
    if actions is None or not actions.pending:
        return None
    return actions.pending


def chain_threads(reaction: Reaction[Any]) -> tuple[str, ...]:
    """The threads of the events that made the rule fire, in order, without repeats."""
    threads: dict[str, None] = {}
    for envelope in reaction.events:
        thread_id = envelope.data.get("thread_id")
        if isinstance(thread_id, str) and thread_id:
            threads[thread_id] = None
    return tuple(threads)


class RunActions:
    """What one attempt of one run may do in artifactr, as its rule's participant."""

    def __init__(self, bridge: Bridge, reaction: Reaction[Any]) -> None:
        run, rule = reaction.run, reaction.rule
        self._bridge = bridge
        self._run = run
        self.rule: Final = rule.name
        self.workspace: Final = WorkspaceKey(
            reaction.workspace.tenant_id, reaction.workspace.workspace_id
        )
        self.actor: Final = ExternalAgentActor(client_id=f"reflexr:{rule.name}", name=rule.name)
        self._cause = Cause(
            correlation_id=run.correlation_id,
            firing_id=run.causation.firing_id,
            run_id=run.id,
            depth=run.depth,
        )
        self._ids = IdDeriver(run.id)
        self._chain: list[str] = list(chain_threads(reaction))
        self._handle: Workspace | None = None
        self.pending = LedgerWrites()
        """What the run's completion commits: rows known only after their write."""
        self._log = logger.bind(
            run_id=run.id,
            rule=rule.name,
            attempt=run.attempts,
            tenant=self.workspace.tenant_id,
            workspace=self.workspace.workspace_id,
        )

    @property
    def threads(self) -> tuple[str, ...]:
        """The run's chain: its events' threads, then the threads it created."""
        return tuple(self._chain)

    @property
    def allowlist(self) -> Allowlist:
        """The rule's permissions as the allowlist in force says now."""
        return self._bridge.allowlists().for_rule(self.rule)

    async def notice(self, content: str, *, thread_id: str | None = None) -> str:
        """Post a notice, which starts no turn; return its message id.

        A used id means an earlier attempt posted it: done, not an error.
        """
        thread = self._thread(thread_id, "notice")
        return await self._notice(content, thread)

    async def send(self, content: str, *, thread_id: str | None = None) -> str:
        """Post a message that starts (or steers) the thread's agent turn; return its id.

        Only for a rule whose allowlist grants ``turns``: otherwise it fails ``not_allowed``
        and writes nothing. When an earlier attempt committed the message, it asks for the
        thread's turn instead (ADR-0026), so a send retried after a crash still gets its turn,
        and one whose turn already ran starts none.
        """
        thread = self._thread(thread_id, "send")
        allowed = self.allowlist
        if not allowed.turns:
            raise self._refuse(
                "send",
                f"rule {self.rule} may not start turns; post a notice",
                thread_id=thread,
            )
        return await self._send(content, thread)

    async def post(self, content: str, *, thread_id: str | None = None) -> str:
        """Post a message routed by the allowlist, not by the caller; return its id.

        With ``turns`` granted it is a send, otherwise a notice, so operators grant or revoke
        turns without a code change and without failing runs. The emission record's ``policy``
        says which route was taken. Both routes derive the same id, so a retry after the grant
        changed still finds the message an earlier attempt posted.
        """
        thread = self._thread(thread_id, "post")
        if self.allowlist.turns:
            return await self._send(content, thread)
        return await self._notice(content, thread)

    async def create_thread(self, title: str) -> str:
        """Create a thread, which joins the run's chain; return its id.

        Only with ``create_threads`` granted. A used id means an earlier attempt created it.
        """
        if not self.allowlist.create_threads:
            raise self._refuse("create_thread", f"rule {self.rule} may not create threads")
        thread_id = self._ids.next(
            "thr", segment=self._segment, operation="create_thread", subject=(title,)
        )
        handle = await self._workspace()
        try:
            await self._commit(
                handle, CreateThread(thread_id=thread_id, title=title), "thread", thread_id
            )
        except InvalidState:
            pass
        except Rejection as refused:
            raise _failure(refused, f"creating thread {thread_id}") from None
        if thread_id not in self._chain:
            self._chain.append(thread_id)
        self._log.info("thread created", thread_id=thread_id)
        return thread_id

    async def create(self, artifact: Artifact, *, thread_id: str | None = None) -> str:
        """Create an artifact: a proposal, unless its kind is in ``direct``.

        Returns the proposal's id, or the artifact's for a direct write.
        """
        thread = None if thread_id is None else self._thread(thread_id, "create")
        if thread is not None and thread not in self._chain:
            await self._existing_thread(thread)
        data = artifact.model_dump(mode="json")
        proposal_id, artifact_id = self._ids.next_ids(
            ("prp", "art"),
            segment=self._segment,
            operation="create_artifact",
            subject=(artifact.kind, digest(_canonical(data))),
        )
        command = create_artifact(artifact, artifact_id=artifact_id, thread_id=thread)
        command = command.model_copy(update={"proposal_id": proposal_id})
        return await self._change(command, artifact.kind, proposal_id, artifact_id)

    async def edit(self, artifact_id: str, path: str, value: Any) -> str | None:
        """Set the value at a JSON pointer ``path`` of an artifact.

        Skipped (None) when the value is already in place; otherwise a proposal, unless the
        artifact's kind is in ``direct``. A version conflict re-reads the artifact and tries
        again, a bounded number of times. Returns the proposal's id, or the artifact's.
        """
        self._check_id("artifact", artifact_id)
        proposal_id = self._ids.next(
            "prp", segment=self._segment, operation="edit_artifact", subject=(artifact_id, path)
        )
        handle = await self._workspace()
        for _ in range(EDIT_CONFLICT_TRIES):
            current = await self._read(handle, artifact_id)
            data = current.data.model_dump(mode="json")
            try:
                found = _pointer_value(data, path)
            except ValueError as bad:
                raise self._permanent(str(bad), "invalid_path") from None
            if found == (value,):
                self._log.info("edit skipped: value in place", artifact_id=artifact_id, path=path)
                return None
            patch = JsonPatch(ops=({"op": "add", "path": path, "value": value},))
            command = EditArtifact(
                artifact_id=artifact_id,
                base_version=current.version,
                patch=patch,
                proposal_id=proposal_id,
            )
            try:
                return await self._change(command, current.kind, proposal_id, artifact_id)
            except _Conflict:
                continue
        raise RunFailure(
            f"artifact {artifact_id} kept changing under the edit of {path} "
            f"({EDIT_CONFLICT_TRIES} version conflicts)",
            reason="version_conflict",
        )

    async def archive(self, artifact_id: str) -> str | None:
        """Archive an artifact: a proposal, unless its kind is in ``direct``.

        Skipped (None) when it is archived already.
        """
        self._check_id("artifact", artifact_id)
        proposal_id = self._ids.next(
            "prp", segment=self._segment, operation="archive_artifact", subject=(artifact_id,)
        )
        handle = await self._workspace()
        for _ in range(EDIT_CONFLICT_TRIES):
            current = await self._read(handle, artifact_id)
            if current.archived:
                return None
            command = ArchiveArtifact(
                artifact_id=artifact_id, base_version=current.version, proposal_id=proposal_id
            )
            try:
                return await self._change(command, current.kind, proposal_id, artifact_id)
            except _Conflict:
                continue
        raise RunFailure(
            f"artifact {artifact_id} kept changing under its archiving", reason="version_conflict"
        )

    @property
    def _segment(self) -> int:
        return self._run.checkpoints

    def _thread(self, thread_id: str | None, operation: str) -> str:
        if thread_id is None:
            if not self._chain:
                raise self._permanent(
                    f"run {self._run.id} of rule {self.rule} has no thread to {operation} in: "
                    "its events carry no thread_id and it created none",
                    NO_THREAD,
                )
            return self._chain[0]
        if thread_id not in self._chain and self.allowlist.threads == "chain":
            raise self._refuse(
                operation,
                f"rule {self.rule} may act only in its run's threads "
                f"({', '.join(self._chain) or 'none'}), not in {thread_id!r}",
                thread_id=thread_id,
            )
        self._check_id("thread", thread_id)
        return thread_id

    def _permanent(self, message: str, reason: str) -> RunFailure:
        """A write no retry can make: logged and counted as a refusal, nothing written."""
        self._log.warning("write refused", reason=reason, detail=message)
        metrics.record_refusal(reason)
        return RunFailure(message, reason=reason, permanent=True)

    def _refuse(self, operation: str, message: str, **where: str) -> NotAllowed:
        self._log.warning("write refused", refused=operation, reason=NOT_ALLOWED, **where)
        metrics.record_refusal(NOT_ALLOWED)
        return NotAllowed(message)

    def _check_id(self, what: str, value: str) -> None:
        """Refuse an id no storage can hold, before anything is written."""
        problem = "is empty" if not value else _text_problem(value)
        if problem is not None:
            raise self._permanent(
                f"run {self._run.id} of rule {self.rule} named a {what} id that {problem}",
                INVALID_ID,
            )

    def _message_id(self, thread: str, content: str) -> str:
        if not content.strip():
            raise self._permanent(
                f"run {self._run.id} of rule {self.rule} tried to post empty content",
                EMPTY_CONTENT,
            )
        problem = _text_problem(content)
        if problem is not None:
            raise self._permanent(
                f"run {self._run.id} of rule {self.rule} tried to post content that {problem}",
                INVALID_CONTENT,
            )
        return self._ids.next(
            "msg",
            segment=self._segment,
            operation="post_message",
            subject=(thread, digest(content)),
        )

    async def _notice(self, content: str, thread: str) -> str:
        message_id = self._message_id(thread, content)
        handle = await self._workspace()
        command = PostMessage(
            thread_id=thread, content=content, message_id=message_id, kind="notice"
        )
        record = self._record("notice", "notice", "posted", thread, message_id, content)
        try:
            await self._commit(handle, command, "message", message_id, record)
        except ThreadBusy as busy:
            raise _failure(busy, f"posting notice {message_id}") from None
        except InvalidState:
            record = replace(record, outcome="already_posted")
            self.pending.emission(record)
        except Rejection as refused:
            raise _failure(refused, f"posting notice {message_id}") from None
        self._emitted(record)
        return message_id

    async def _send(self, content: str, thread: str) -> str:
        runner = self._bridge.runner
        if runner is None:
            raise self._refuse(
                "send",
                f"rule {self.rule} may start turns, but this application runs no agent",
                thread_id=thread,
            )
        message_id = self._message_id(thread, content)
        # a send may start a turn: its cause is committed before anything else (ADR-0023)
        await retried(
            lambda: self._bridge.ledger.record_cause(
                self.workspace, "message", message_id, self._cause
            )
        )
        handle = await self._workspace()
        outcome: Outcome = "posted"
        try:
            sent = await retried(
                lambda: runner.send(handle, thread, content, message_id=message_id)
            )
            started = sent.run
        except ThreadBusy as busy:
            raise _failure(busy, f"sending message {message_id}") from None
        except InvalidState:
            outcome = "asked"
            try:
                started = await retried(lambda: runner.ask(handle, thread))
            except Rejection as refused:
                raise _failure(refused, f"asking for the turn of message {message_id}") from None
        except Rejection as refused:
            raise _failure(refused, f"sending message {message_id}") from None
        self._bridge.turns.started(started, again=lambda: runner.ask(handle, thread))
        record = self._record("message", "turn", outcome, thread, message_id, content)
        self.pending.emission(record)
        self._emitted(record, turn=None if started is None else started.run_id)
        return message_id

    async def _change(
        self,
        command: CreateArtifact | EditArtifact | ArchiveArtifact,
        kind: str,
        proposal_id: str,
        artifact_id: str,
    ) -> str:
        direct = kind in self.allowlist.direct
        write: WriteKind = "artifact" if direct else "proposal"
        key = artifact_id if direct else proposal_id
        handle = await self._workspace()
        made = command if direct else ProposeChange(proposal_id=proposal_id, change=command)
        try:
            await self._commit(handle, made, write, key)
        except VersionConflict:
            raise _Conflict() from None
        except InvalidState:
            self._log.info(f"{command.type} already made", write=write, id=key)
            return key
        except Rejection as refused:
            raise _failure(refused, f"{command.type} of {artifact_id}") from None
        self._log.info(f"{command.type} made", write=write, id=key, artifact_id=artifact_id)
        return key

    async def _existing_thread(self, thread_id: str) -> None:
        """A proposal may name a thread artifactr does not check: check it here."""
        handle = await self._workspace()
        try:
            await handle.thread(thread_id)
        except Rejection as refused:
            raise _failure(refused, f"reading thread {thread_id}") from None

    async def _read(self, handle: Workspace, artifact_id: str) -> Any:
        try:
            return await handle.artifact(artifact_id)
        except Rejection as refused:
            raise _failure(refused, f"reading artifact {artifact_id}") from None

    async def _workspace(self) -> Workspace:
        if self._handle is None:
            try:
                self._handle = await self._bridge.artifacts.open(
                    self.workspace.tenant_id, self.workspace.workspace_id, actor=self.actor
                )
            except Rejection as refused:
                raise _failure(refused, f"opening workspace {self.workspace}") from None
        return self._handle

    async def _commit(
        self,
        handle: Workspace,
        command: Command,
        kind: WriteKind,
        key: str,
        record: EmissionRecord | None = None,
    ) -> None:
        """Commit ``command``; the write's cause (and ``record``) ride in its transaction.

        A transient storage fault is retried: the command's id is derived, so a commit that
        did land is refused as used (``InvalidState``) the second time. When the commit is
        refused, the cause waits for the run's completion (an earlier attempt made the write,
        or none will, and a cause without its write is harmless).
        """
        writes = LedgerWrites()
        writes.cause(self.workspace, kind, key, self._cause)
        if record is not None:
            writes.emission(record)
        try:
            async with self._bridge.ledger.alongside(writes):
                await retried(lambda: handle.commit(command))
        except Rejection:
            if not writes.committed:
                self.pending.cause(self.workspace, kind, key, self._cause)
            raise

    def _record(
        self,
        kind: EmissionKind,
        policy: Policy,
        outcome: Outcome,
        thread: str,
        message_id: str,
        content: str,
    ) -> EmissionRecord:
        return EmissionRecord(
            kind=kind,
            rule=self.rule,
            run_id=self._run.id,
            attempt=self._run.attempts,
            epoch=self._run.epoch,
            tenant_id=self.workspace.tenant_id,
            workspace_id=self.workspace.workspace_id,
            thread_id=thread,
            message_id=message_id,
            policy=policy,
            outcome=outcome,
            content=content,
            emitted_at=self._bridge.clock(),
        )

    def _emitted(self, record: EmissionRecord, *, turn: str | None = None) -> None:
        metrics.record_emission(record.kind, record.outcome)
        self._log.info(
            "emission",
            kind=record.kind,
            policy=record.policy,
            outcome=record.outcome,
            thread_id=record.thread_id,
            message_id=record.message_id,
            turn_id=turn,
        )


class _Conflict(Exception):
    """An artifact changed between the read and the write: read it again."""


def _failure(refused: Rejection, doing: str) -> RunFailure:
    """artifactr's refusal as the attempt's failure, with artifactr's code as the reason."""
    code = refused.code
    if isinstance(refused, ThreadBusy):
        code = "thread_busy"
    retried = code in RETRIED_REJECTIONS or code == "thread_busy"
    if not retried:
        metrics.record_refusal(code)
    logger.warning("write refused by artifactr", doing=doing, reason=code, retried=retried)
    return RunFailure(f"{doing}: {refused.message}", reason=code, permanent=not retried)


def _text_problem(text: str) -> str | None:
    """What keeps ``text`` out of every storage: a NUL, or a lone surrogate (not UTF-8)."""
    if "\x00" in text:
        return "holds a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        return f"is not unicode text (a lone surrogate at {bad.start})"
    return None


def _canonical(data: Mapping[str, Any]) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _pointer_value(data: Any, path: str) -> tuple[Any] | tuple[()]:
    """The value at a JSON pointer, as a 1-tuple, or () when nothing is there."""
    if path == "":
        return (data,)
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not a JSON pointer")
    node = data
    for raw in path[1:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return ()
    return (node,)
