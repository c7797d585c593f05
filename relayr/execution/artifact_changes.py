"""ArtifactChanges: a run's creates, edits and archives of artifacts, proposed or made directly.

Each change is a proposal unless the allowlist makes its kind ``direct`` and the kind's type
lets a rule write it (a create in a thread in ``suggest`` mode is a proposal all the same).
Its ids are derived from the run, so a retried attempt finds what an earlier one made: the
proposal, or the artifact. A direct edit leaves a row in the ledger that rides its write, and a
retry that finds it makes the edit no more, whatever changed the artifact since (ADR-0102). An
edit or an archive reads the artifact first and is skipped when it is done already; a version
conflict reads it again, a bounded number of times (:data:`EDIT_CONFLICT_TRIES`). A direct
write's cause is kept under the revision it makes (ADR-0065); what artifactr made of a change is
what is reported (ADR-0062).
"""

from typing import Any, Final

from artifactr import Artifact, JsonPatch, Proposed, VersionConflict, Versioned
from artifactr.core import (
    ArchiveArtifact,
    CreateArtifact,
    EditArtifact,
    InvalidState,
    NotFound,
    ProposeChange,
    create_artifact,
    get_artifact_type,
)
from reflexr.workspace import RunFailure

from relayr.core import reasons
from relayr.core.ids import canonical, digest
from relayr.core.refusals import Refusal
from relayr.core.routing import archived_refusal, id_refusal, is_direct, pointer_value, thread_for
from relayr.execution.participant import RunParticipant
from relayr.ledger.port import WriteKind, edit_key, revision_key

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
