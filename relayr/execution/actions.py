"""RunActions: a rule's run acting in artifactr as its rule's own participant.

A run acts as ``ExternalAgentActor(client_id="reflexr:<rule>")`` in its own workspace, and every
write has an id derived from the run, so a retried attempt makes each effect once (a used id is
done, not an error; a send asks for its turn again, ADR-0026). Every write is decided by the core
first (:mod:`relayr.core.routing`), its emission record included (ADR-0105), and the allowlist is
checked when the run acts, not when it was queued. Each write's cause and emission record reach
the ledger with the write (a send's record rides the send; what a retry finds is recorded at
once, or the attempt fails ``io_error``, ADR-0103); a record's ``policy`` is the route decided
now (ADR-0101). A refused write's cause waits in :func:`pending_writes` for the run's
completion. Refusals are ``RunFailure``s with a reason from :mod:`relayr.core.reasons`
(ADR-0060).
"""

from contextlib import suppress
from typing import Any, Final
from weakref import WeakKeyDictionary

import structlog
from artifactr import Artifact, ExternalAgentActor, JsonPatch, Proposed, VersionConflict, Versioned
from artifactr.core import (
    ArchiveArtifact,
    CreateArtifact,
    CreateThread,
    EditArtifact,
    InvalidState,
    NotFound,
    PostMessage,
    ProposeChange,
    create_artifact,
    get_artifact_type,
)
from reflexr.workspace import Reaction, RunFailure

from relayr.core import reasons
from relayr.core.allowlist import Allowlist
from relayr.core.ids import IdDeriver, canonical, digest
from relayr.core.refusals import Refusal
from relayr.core.routing import (
    PostOperation,
    Route,
    Writer,
    archived_refusal,
    content_refusal,
    id_refusal,
    is_direct,
    may_create_thread,
    pointer_value,
    route,
    thread_for,
)
from relayr.execution.writes import Writes
from relayr.ledger.port import Cause, LedgerWrites, WorkspaceKey, WriteKind, edit_key, revision_key
from relayr.observe import hooks, telemetry
from relayr.observe.hooks import WriteRefused
from relayr.runtime.bridge import Bridge

logger = structlog.get_logger("relayr.actions")


def chain_threads(reaction: Reaction[Any]) -> tuple[str, ...]:
    """The threads of the events that made the rule fire, in order, without repeats."""
    threads: dict[str, None] = {}
    for envelope in reaction.events:
        thread_id = envelope.data.get("thread_id")
        if isinstance(thread_id, str) and thread_id:
            threads[thread_id] = None
    return tuple(threads)


class RunParticipant:
    """One attempt of one run in artifactr, as its rule's participant: what its actions share."""

    def __init__(self, bridge: Bridge, reaction: Reaction[Any]) -> None:
        run, rule = reaction.run, reaction.rule
        self._bridge = bridge
        self._run = run
        self.rule: Final = rule.name
        self.workspace: Final = WorkspaceKey(
            reaction.workspace.tenant_id, reaction.workspace.workspace_id
        )
        self.actor: Final = ExternalAgentActor(client_id=f"reflexr:{rule.name}", name=rule.name)
        self._writer = Writer(rule=rule.name, run_id=run.id)
        self._ids = IdDeriver(run.id)
        self._chain: list[str] = list(chain_threads(reaction))
        self.started_turns = False
        """Whether this attempt sent a message that starts (or asked for) a turn."""
        self._log = logger.bind(
            run_id=run.id,
            rule=rule.name,
            attempt=run.attempts,
            tenant=self.workspace.tenant_id,
            workspace=self.workspace.workspace_id,
        )
        cause = Cause(
            correlation_id=run.correlation_id,
            firing_id=run.causation.firing_id,
            run_id=run.id,
            depth=run.depth,
        )
        self._writes = Writes(bridge, self.workspace, self.actor, cause, self._log)

    @property
    def pending(self) -> LedgerWrites:
        """What the run's completion commits: rows known only after their write."""
        return self._writes.pending

    @property
    def threads(self) -> tuple[str, ...]:
        """The run's chain: its events' threads, then the threads it created."""
        return tuple(self._chain)

    @property
    def allowlist(self) -> Allowlist:
        """The rule's permissions as the allowlist in force says now."""
        return self._bridge.allowlists().for_rule(self.rule)

    @property
    def _segment(self) -> int:
        return self._run.checkpoints

    def _decided[T](self, decision: T | Refusal, operation: str, **where: str) -> T:
        """The core's decision, or its refusal raised as the attempt's failure."""
        if isinstance(decision, Refusal):
            raise self._writes.refused(decision, operation, **where)
        return decision


EDIT_CONFLICT_TRIES: Final = 5
"""How often an edit re-reads its artifact after a version conflict before it fails the
attempt (retried): enough for a busy artifact, bounded so a hot one cannot hold a worker."""


class ArtifactChanges(RunParticipant):
    """What one attempt may change of its workspace's artifacts, as its rule's participant."""

    async def create(self, artifact: Artifact, *, thread_id: str | None = None) -> str:
        """Create an artifact: a proposal, unless its kind is in ``direct`` and artifactr
        applies it (:meth:`writes_directly`; not in a thread in ``suggest`` mode either).

        Returns the proposal's id, or the artifact's when it was created directly (by this
        attempt or an earlier one).
        """
        thread = None
        if thread_id is not None:
            thread = self._decided(
                thread_for(self.allowlist, "create", thread_id, self._chain, self._writer),
                "create",
                thread_id=thread_id,
            )
        direct = self.writes_directly(artifact.kind)
        if thread is not None and (direct or thread not in self._chain):
            # a proposal may name a thread artifactr does not check; a direct write in a
            # thread in suggest mode is a proposal too
            suggesting = (await self._writes.thread(thread)).mode == "suggest"
            direct = direct and not suggesting
        data = artifact.model_dump(mode="json")
        proposal_id, artifact_id = self._ids.next_ids(
            ("prp", "art"),
            segment=self._segment,
            operation="create_artifact",
            subject=(artifact.kind, digest(canonical(data))),
        )
        command = create_artifact(artifact, artifact_id=artifact_id, thread_id=thread)
        command = command.model_copy(update={"proposal_id": proposal_id})
        try:
            return await self._change(command, direct, proposal_id, artifact_id)
        except _StateRefused as refused:
            if await self._writes.artifact_or_none(artifact_id) is not None:
                # an earlier attempt created it directly (the allowlist changed since)
                return artifact_id
            raise self._writes.refused_by_artifactr(refused.rejection, refused.doing) from None

    async def edit(self, artifact_id: str, path: str, value: Any) -> str | None:
        """Set the value at a JSON pointer ``path`` of an artifact.

        Skipped (the artifact's id) when an earlier attempt made this edit directly: the ledger
        holds its row, so a person's change since is not overwritten. Skipped (None) when the
        value is already in place; otherwise a proposal, unless the artifact's kind is in
        ``direct`` and artifactr applies it (:meth:`writes_directly`).
        An archived artifact is refused (``artifact_archived``, permanent), unless an earlier
        attempt already proposed this edit. A version conflict re-reads the artifact and tries
        again, a bounded number of times. artifactr's refusal for the artifact's state (it was
        archived after the read) reads it again and decides as above. Returns the proposal's
        id, or the artifact's.
        """
        self._check_id("artifact", artifact_id)
        proposal_id = self._ids.next(
            "prp", segment=self._segment, operation="edit_artifact", subject=(artifact_id, path)
        )
        made = edit_key(proposal_id, digest(canonical({"value": value})))
        if await self._writes.made("edit", made):
            self._log.info("edit skipped: made by an earlier attempt", artifact_id=artifact_id)
            return artifact_id
        for _ in range(EDIT_CONFLICT_TRIES):
            current = await self._writes.artifact(artifact_id)
            if self._in_place(current, path, value):
                self._log.info("edit skipped: value in place", artifact_id=artifact_id, path=path)
                return None
            if current.archived:
                return await self._archived(artifact_id, proposal_id, path)
            patch = JsonPatch(ops=({"op": "add", "path": path, "value": value},))
            command = EditArtifact(
                artifact_id=artifact_id,
                base_version=current.version,
                patch=patch,
                proposal_id=proposal_id,
            )
            direct = self.writes_directly(current.kind)
            try:
                return await self._change(command, direct, proposal_id, artifact_id, made)
            except _Conflict:
                continue
            except _StateRefused as refused:
                # artifactr refused it for the artifact's state, which changed since the read
                again = await self._writes.artifact(artifact_id)
                if self._in_place(again, path, value):
                    return None
                if again.archived:
                    return await self._archived(artifact_id, proposal_id, path)
                raise self._writes.refused_by_artifactr(refused.rejection, refused.doing) from None
        raise RunFailure(
            f"artifact {artifact_id} kept changing under the edit of {path} "
            f"({EDIT_CONFLICT_TRIES} version conflicts)",
            reason=reasons.VERSION_CONFLICT,
        )

    async def archive(self, artifact_id: str) -> str | None:
        """Archive an artifact: a proposal, unless its kind is in ``direct`` and artifactr
        applies it (:meth:`writes_directly`).

        Skipped (None) when it is archived already, also when that happened after the read.
        Returns the proposal's id, or the artifact's.
        """
        self._check_id("artifact", artifact_id)
        proposal_id = self._ids.next(
            "prp", segment=self._segment, operation="archive_artifact", subject=(artifact_id,)
        )
        for _ in range(EDIT_CONFLICT_TRIES):
            current = await self._writes.artifact(artifact_id)
            if current.archived:
                return None
            command = ArchiveArtifact(
                artifact_id=artifact_id, base_version=current.version, proposal_id=proposal_id
            )
            direct = self.writes_directly(current.kind)
            try:
                return await self._change(command, direct, proposal_id, artifact_id)
            except _Conflict:
                continue
            except _StateRefused as refused:
                if (await self._writes.artifact(artifact_id)).archived:
                    return None  # archived since the read, by someone else
                raise self._writes.refused_by_artifactr(refused.rejection, refused.doing) from None
        raise RunFailure(
            f"artifact {artifact_id} kept changing under its archiving",
            reason=reasons.VERSION_CONFLICT,
        )

    def writes_directly(self, kind: str) -> bool:
        """Whether this rule's change of an artifact of ``kind`` is applied, not proposed: the
        allowlist makes the kind ``direct``, and its type's ``write_policy`` does not make
        agents propose (a rule writes as one). A thread in ``suggest`` mode makes a proposal
        of a create that names it all the same (:meth:`create` reads it)."""
        try:
            write_policy = get_artifact_type(kind).write_policy
        except NotFound:
            write_policy = "direct"  # no such type here: artifactr refuses the write itself
        return is_direct(self.allowlist, kind, write_policy)

    async def artifact(self, artifact_id: str) -> Versioned[Artifact]:
        """Read an artifact as it is now, archived or not, as the rule's participant.

        Through the attempt's one workspace handle, retried on transient faults as its writes
        are; refused as the attempt's ``RunFailure`` (``not_found``, ``storage_unavailable``).
        """
        self._check_id("artifact", artifact_id)
        return await self._writes.artifact(artifact_id)

    def _check_id(self, what: str, value: str) -> None:
        """Refuse an id no storage can hold, before anything is written."""
        refused = id_refusal(what, value, self._writer)
        if refused is not None:
            raise self._writes.refused(refused, what)

    async def _change(
        self,
        command: CreateArtifact | EditArtifact | ArchiveArtifact,
        direct: bool,
        proposal_id: str,
        artifact_id: str,
        edit: str | None = None,
    ) -> str:
        """Make ``command`` (``direct``) or propose it; return the id it is found by: the
        artifact's if artifactr applied it, else the proposal's.

        A direct write's cause is kept under the revision it makes (an artifact's id is every
        writer's, ADR-0065), and under its proposal's id, which artifactr records instead if
        the thread went into ``suggest`` mode since it was read. A write that is not direct
        leaves no revision's cause: whoever makes that version (a person accepting the
        proposal) starts a chain of their own. A direct edit's row (its key ``edit``) rides
        the write too, and only the write (ADR-0102).

        Raises:
            _Conflict: The artifact changed since the read (a version conflict).
            _StateRefused: artifactr refused the write for the artifact's state (an
                ``InvalidState``) and no proposal of it exists: the caller reads again.
        """
        doing = f"{command.type} of {artifact_id}"
        made = command if direct else ProposeChange(proposal_id=proposal_id, change=command)
        keys: list[tuple[WriteKind, str]] = [("proposal", proposal_id)]
        if direct:
            made_version = 1 if isinstance(command, CreateArtifact) else command.base_version + 1
            keys.append(("revision", revision_key(artifact_id, made_version)))
            if edit is not None:
                keys.append(("edit", edit))
        try:
            outcome = await self._writes.commit(made, keys, doing=doing)
        except VersionConflict:
            raise _Conflict() from None
        except InvalidState as refused:
            if await self._writes.proposal_exists(proposal_id):
                self._log.info(f"{command.type} already proposed", proposal_id=proposal_id)
                return proposal_id
            raise _StateRefused(refused, doing) from None
        if isinstance(outcome, Proposed):
            self._log.info(
                f"{command.type} proposed", proposal_id=outcome.proposal_id, artifact_id=artifact_id
            )
            return outcome.proposal_id
        self._log.info(f"{command.type} made", artifact_id=artifact_id)
        return artifact_id

    async def _archived(self, artifact_id: str, proposal_id: str, path: str) -> str:
        """An edit of an archived artifact: the proposal an earlier attempt made, else refused."""
        if await self._writes.proposal_exists(proposal_id):
            return proposal_id
        refusal = archived_refusal(artifact_id, path, self._writer)
        raise self._writes.refused(refusal, "edit", artifact_id=artifact_id)

    def _in_place(self, current: Versioned[Artifact], path: str, value: Any) -> bool:
        """Whether ``value`` is at ``path`` of the artifact; ``invalid_path`` if ``path`` is
        not a JSON pointer."""
        try:
            return pointer_value(current.data.model_dump(mode="json"), path) == (value,)
        except ValueError as bad:
            raise self._writes.refused(
                Refusal(reasons.INVALID_PATH, str(bad)), "edit", artifact_id=current.id
            ) from None


class _Conflict(Exception):
    """An artifact changed between the read and the write: read it again."""


class _StateRefused(Exception):
    """artifactr refused a change for its artifact's state (``InvalidState``), and no proposal
    of it exists: the caller reads the artifact again to tell what happened."""

    def __init__(self, rejection: InvalidState, doing: str) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection
        self.doing = doing


class MissingRunContext(RunFailure, TypeError):
    """Raised when an action asks to act for a run relayr does not execute; permanent.

    A ``TypeError`` too: the action was called with deps that are not relayr's bridge.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, reason=reasons.MISSING_RUN_CONTEXT, permanent=True)


_acting: WeakKeyDictionary[Reaction[Any], "RunActions"] = WeakKeyDictionary()


def acting(reaction: Reaction[Any]) -> "RunActions":
    """Return the RunActions of this attempt: the one call an action makes to act in artifactr.

    The same reaction always gets the same RunActions, so the ids of its writes are counted
    across the whole attempt however often the action asks.

    Raises:
        MissingRunContext: If the reaction's ``deps`` is not a
        :class:`~relayr.runtime.bridge.Bridge`:
            the run is not executed by relayr (``missing_run_context``, also a ``TypeError``).
    """
    actions = _acting.get(reaction)
    if actions is None:
        if not isinstance(reaction.deps, Bridge):
            hooks.emit(WriteRefused(reasons.MISSING_RUN_CONTEXT))
            raise MissingRunContext(
                f"run {reaction.run_id} is not executed by relayr: its deps are not a Bridge"
            )
        actions = _acting[reaction] = RunActions(reaction.deps, reaction)
    return actions


def started_turns(reaction: Reaction[Any] | None) -> bool:
    """Whether the attempt sent a message that starts a turn, or asked for its turn: the
    turn's ``turns_in_flight`` slot is held until the turn ends."""
    actions = None if reaction is None else _acting.get(reaction)
    return actions is not None and actions.started_turns


def pending_writes(reaction: Reaction[Any]) -> LedgerWrites | None:
    """The ledger rows this attempt's actions left for the run's completion to commit, if any."""
    actions = _acting.get(reaction)
    if actions is None or not actions.pending:
        return None
    return actions.pending


class RunActions(ArtifactChanges):
    """What one attempt of one run may do in artifactr, as its rule's participant: messages and
    threads here, changes of artifacts as :class:`ArtifactChanges`."""

    async def notice(self, content: str, *, thread_id: str | None = None) -> str:
        """Post a notice, which starts no turn; return its message id.

        A used id means an earlier attempt posted it: done, not an error.
        """
        return await self._post("notice", content, thread_id)

    async def send(self, content: str, *, thread_id: str | None = None) -> str:
        """Post a message that starts (or steers) the thread's agent turn; return its id.

        Only for a rule whose allowlist grants ``turns``: otherwise it fails ``not_allowed``
        and writes nothing. When an earlier attempt committed the message, it asks for the
        thread's turn instead (ADR-0026), so a send retried after a crash still gets its turn,
        and one whose turn already ran starts none.
        """
        return await self._post("send", content, thread_id)

    async def post(self, content: str, *, thread_id: str | None = None) -> str:
        """Post a message routed by the allowlist, not by the caller; return its id.

        With ``turns`` granted it is a send, otherwise a notice, so operators grant or revoke
        turns without a code change and without failing runs. The emission record's ``policy``
        says which route was taken. Both routes derive the same id, so a retry after the grant
        changed still finds the message an earlier attempt posted, and records what it was.
        """
        return await self._post("post", content, thread_id)

    async def create_thread(self, title: str) -> str:
        """Create a thread, which joins the run's chain; return its id.

        Only with ``create_threads`` granted. A used id means an earlier attempt created it.
        """
        refused = may_create_thread(self.allowlist, self._writer)
        if refused is not None:
            raise self._writes.refused(refused, "create_thread")
        thread_id = self._ids.next(
            "thr", segment=self._segment, operation="create_thread", subject=(title,)
        )
        with suppress(InvalidState):  # used: an earlier attempt created it
            await self._writes.commit(
                CreateThread(thread_id=thread_id, title=title),
                [("thread", thread_id)],
                doing=f"creating thread {thread_id}",
            )
        if thread_id not in self._chain:
            self._chain.append(thread_id)
        self._log.info("thread created", thread_id=thread_id)
        return thread_id

    async def _post(self, operation: PostOperation, content: str, thread_id: str | None) -> str:
        """Post as the core routes it: a notice, or a send that starts a turn."""
        decided = route(
            self.allowlist,
            operation,
            thread_id,
            self._chain,
            self._writer,
            agent=self._bridge.runner is not None,
        )
        where = {"thread_id": thread_id} if thread_id is not None else {}
        chosen: Route = self._decided(decided, operation, **where)
        self._decided(content_refusal(content, self._writer), operation, **where)
        message_id = self._ids.next(
            "msg",
            segment=self._segment,
            operation="post_message",
            subject=(chosen.thread_id, digest(content)),
        )
        traced = {
            telemetry.RULE: self.rule,
            telemetry.RUN_ID: self._run.id,
            telemetry.ATTEMPT: self._run.attempts,
            telemetry.THREAD_ID: chosen.thread_id,
            telemetry.MESSAGE_ID: message_id,
        }
        # a span per write, never its content: what the emission record says, it says
        with telemetry.span("relayr.send" if chosen.turn else "relayr.notice", traced):
            if chosen.turn:
                return await self._send(content, chosen.thread_id, message_id)
            return await self._notice(content, chosen.thread_id, message_id)

    async def _notice(self, content: str, thread: str, message_id: str) -> str:
        command = PostMessage(
            thread_id=thread, content=content, message_id=message_id, kind="notice"
        )
        record = self._writes.record(
            self._run, "notice", "posted", thread, message_id, content, policy="notice"
        )
        try:
            await self._writes.commit(
                command, [("message", message_id)], record, doing=f"posting notice {message_id}"
            )
        except InvalidState:
            held = await self._writes.held_kind(thread, message_id)
            record = self._writes.record(
                self._run,
                held or "notice",
                "already_posted",
                thread,
                message_id,
                content,
                policy="notice",
            )
            await self._writes.write_record(record)
        self._writes.emitted(record)
        return message_id

    async def _send(self, content: str, thread: str, message_id: str) -> str:
        runner = self._bridge.runner
        assert runner is not None, "the core routes no send without an agent"
        posted = self._writes.record(
            self._run, "message", "posted", thread, message_id, content, policy="turn"
        )
        # a send may start a turn: its cause is committed before anything else (ADR-0023)
        await self._writes.record_cause("message", message_id)
        try:  # the record rides the message's commit (ADR-0103)
            started = (await self._writes.send(runner, thread, content, posted)).run
            record = posted
        except InvalidState:
            held = await self._writes.held_kind(thread, message_id)
            if held == "notice":
                # an earlier attempt posted it as a notice: no turn waits for it (ADR-0062)
                record = self._writes.record(
                    self._run,
                    "notice",
                    "already_posted",
                    thread,
                    message_id,
                    content,
                    policy="turn",
                )
                await self._writes.write_record(record)
                self._writes.emitted(record)
                return message_id
            handle = await self._writes.handle()
            started = await self._writes.guarded(
                f"asking for the turn of message {message_id}", lambda: runner.ask(handle, thread)
            )
            record = self._writes.record(
                self._run, "message", "asked", thread, message_id, content, policy="turn"
            )
            await self._writes.write_record(record)
        self.started_turns = True
        handle = await self._writes.handle()
        self._bridge.turns.started(started, ask_again=lambda: runner.ask(handle, thread))
        self._writes.emitted(record, turn=None if started is None else started.run_id)
        return message_id
