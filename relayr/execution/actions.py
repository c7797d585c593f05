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
from typing import Any
from weakref import WeakKeyDictionary

from artifactr.core import CreateThread, InvalidState, PostMessage
from reflexr.workspace import Reaction, RunFailure

from relayr.core import reasons
from relayr.core.ids import digest
from relayr.core.routing import PostOperation, Route, content_refusal, may_create_thread, route
from relayr.execution.artifact_changes import ArtifactChanges
from relayr.ledger.port import LedgerWrites
from relayr.observe import hooks, telemetry
from relayr.observe.hooks import WriteRefused
from relayr.runtime.bridge import Bridge


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


def pending_writes(reaction: Reaction[Any]) -> LedgerWrites | None:
    """The ledger rows this attempt's actions left for the run's completion to commit, if any."""
    actions = _acting.get(reaction)
    if actions is None or not actions.pending:
        return None
    return actions.pending


class RunActions(ArtifactChanges):
    """What one attempt of one run may do in artifactr, as its rule's participant: messages and
    threads here, changes of artifacts as
    :class:`~relayr.execution.artifact_changes.ArtifactChanges`."""

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
        handle = await self._writes.handle()
        self._bridge.turns.started(started, ask_again=lambda: runner.ask(handle, thread))
        self._writes.emitted(record, turn=None if started is None else started.run_id)
        return message_id
