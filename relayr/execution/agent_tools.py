"""A rule's agent acting through tools: the run's :class:`~relayr.execution.actions.RunActions` as a
pydantic-ai toolset, and the capability that gives it to an agent (ADR-0066).

An action that hands its work to a model runs the agent with the run's tools::

    agent = Agent(model, deps_type=RuleTools, capabilities=[RuleCapability(types=[Note])])
    result = await agent.run("...", deps=RuleTools.of(reaction))

Each tool is one of the run's own reads or writes, so the agent acts as the rule, where the
allowlist lets it, and a retried attempt makes each write once. A refusal the model can act on
goes back to it as ``ModelRetry`` (at most :data:`TOOL_RETRIES` times); any other fails the run.
"""

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Final, Self, override

from artifactr import Artifact
from artifactr.agent.tools import artifact_text
from pydantic import JsonValue, ValidationError
from pydantic_ai import FunctionToolset, ModelRetry, RunContext
from pydantic_ai.capabilities import AbstractCapability
from reflexr.workspace import Reaction, RunFailure

from relayr.core import reasons
from relayr.execution.actions import RunActions, acting

TOOL_RETRIES: Final = 2
"""How many retry prompts one tool gets in a run before the run fails: enough for a model to
fix an argument it got wrong, bounded so a model that keeps asking for what the allowlist
refuses ends the attempt."""

RETRY_PROMPTS: Final = frozenset(
    {
        reasons.NOT_ALLOWED,
        reasons.NO_THREAD,
        reasons.EMPTY_CONTENT,
        reasons.INVALID_CONTENT,
        reasons.INVALID_ID,
        reasons.INVALID_PATH,
        reasons.THREAD_NOT_FOUND,
        reasons.NOT_FOUND,
        reasons.ARTIFACT_ARCHIVED,
        reasons.VALIDATION_FAILED,
        reasons.PATCH_FAILED,
    }
)
"""The refusals that go back to the model as a retry prompt: the allowlist's, and those of an
input that was invalid. Any other refusal fails the run."""


@dataclass
class RuleTools:
    """The deps of a rule's agent: the run's reads and writes.

    Build it with :meth:`of` in the action, once per attempt (``acting`` hands the same
    RunActions to every call of one attempt, so ids count across the agent's tools).

    Attributes:
        actions: The run's reads and writes (:func:`relayr.execution.actions.acting`), through the
            attempt's one workspace handle.
    """

    actions: RunActions

    @classmethod
    def of(cls, reaction: Reaction[Any]) -> Self:
        """The tools' deps for this attempt of a run relayr executes.

        Raises:
            RunFailure: ``missing_run_context`` when relayr does not execute the run.
        """
        return cls(acting(reaction))


async def _refusals_to_model[T](write: Callable[[], Awaitable[T]]) -> T:
    """Make ``write``; a refusal the model can act on becomes its retry prompt."""
    try:
        return await write()
    except RunFailure as refused:
        if refused.reason in RETRY_PROMPTS:
            raise ModelRetry(f"refused ({refused.reason}): {refused.message}") from refused
        raise


def rule_toolset(types: Sequence[type[Artifact]] = ()) -> FunctionToolset[RuleTools]:
    """The tools of a rule's agent: read an artifact, post a notice or a message, create or
    change an artifact (a proposal unless the allowlist makes its kind direct), archive one,
    and create a thread.

    Args:
        types: The artifact kinds the agent may create; their JSON Schemas are given to the
            model once, in ``create_artifact``'s description.
    """
    toolset = FunctionToolset[RuleTools](max_retries=TOOL_RETRIES)
    by_kind = {kind.kind: kind for kind in types}
    schemas = "\n".join(
        f"- {kind.kind}: {json.dumps(kind.model_json_schema(), separators=(',', ':'))}"
        for kind in types
    )

    @toolset.tool
    async def read_artifact(ctx: RunContext[RuleTools], artifact_id: str) -> str:
        """Read an artifact's current version.

        Args:
            artifact_id: The artifact to read.
        """
        actions = ctx.deps.actions
        return artifact_text(await _refusals_to_model(lambda: actions.artifact(artifact_id)))

    @toolset.tool
    async def post_notice(
        ctx: RunContext[RuleTools], content: str, thread_id: str | None = None
    ) -> str:
        """Post a notice for the people in a thread; it never wakes the thread's agent.

        Args:
            content: What to tell them.
            thread_id: The thread; by default the thread of the event the rule fired on.
        """
        actions = ctx.deps.actions
        message_id = await _refusals_to_model(lambda: actions.notice(content, thread_id=thread_id))
        return f"posted notice {message_id}"

    @toolset.tool
    async def post_message(
        ctx: RunContext[RuleTools], content: str, thread_id: str | None = None
    ) -> str:
        """Post a message. It asks the thread's agent to act if the operators let this rule
        start turns; otherwise it is posted as a notice.

        Args:
            content: The message.
            thread_id: The thread; by default the thread of the event the rule fired on.
        """
        actions = ctx.deps.actions
        message_id = await _refusals_to_model(lambda: actions.post(content, thread_id=thread_id))
        return f"posted message {message_id}"

    @toolset.tool(
        description="Create an artifact of one of these kinds, whose data must match its JSON "
        f"Schema (a proposal for people to review, unless the operators let this rule write "
        f"the kind directly):\n{schemas or '- (no kinds: every creation is refused)'}"
    )
    async def create_artifact(
        ctx: RunContext[RuleTools],
        kind: str,
        data: dict[str, Any],
        thread_id: str | None = None,
    ) -> str:
        artifact_type = by_kind.get(kind)
        if artifact_type is None:
            raise ModelRetry(
                f"refused ({reasons.VALIDATION_FAILED}): no artifact kind {kind!r}; "
                f"use one of {', '.join(sorted(by_kind)) or 'none'}"
            )
        try:
            artifact = artifact_type.model_validate(data)
        except ValidationError as invalid:
            raise ModelRetry(
                f"refused ({reasons.VALIDATION_FAILED}): invalid {kind} data: {invalid}"
            ) from None
        actions = ctx.deps.actions
        made = await _refusals_to_model(lambda: actions.create(artifact, thread_id=thread_id))
        return _change_outcome(made, "created")

    @toolset.tool
    async def edit_artifact(
        ctx: RunContext[RuleTools], artifact_id: str, path: str, value: JsonValue
    ) -> str:
        """Set the value at a JSON pointer of an artifact's data (a proposal for people to
        review, unless the operators let this rule write its kind directly).

        Args:
            artifact_id: The artifact to change.
            path: A JSON pointer into its data, such as ``/text``.
            value: The value to put there.
        """
        actions = ctx.deps.actions
        made = await _refusals_to_model(lambda: actions.edit(artifact_id, path, value))
        return _change_outcome(made, "edited")

    @toolset.tool
    async def archive_artifact(ctx: RunContext[RuleTools], artifact_id: str) -> str:
        """Archive an artifact that is no longer needed (a proposal, unless direct).

        Args:
            artifact_id: The artifact to archive.
        """
        actions = ctx.deps.actions
        made = await _refusals_to_model(lambda: actions.archive(artifact_id))
        return _change_outcome(made, "archived")

    @toolset.tool
    async def create_thread(ctx: RunContext[RuleTools], title: str) -> str:
        """Create a thread, where this rule may then post.

        Args:
            title: The thread's title.
        """
        actions = ctx.deps.actions
        thread_id = await _refusals_to_model(lambda: actions.create_thread(title))
        return f"created thread {thread_id}"

    return toolset


def _change_outcome(made: str | None, done: str) -> str:
    if made is None:
        return "nothing to do: the value is already in place"
    if made.startswith("prp_"):
        return f"proposed: proposal {made}, for people to review"
    return f"{done}: artifact {made}"


@dataclass
class RuleCapability(AbstractCapability[RuleTools]):
    """Make an agent act for the rule whose run it works in: the run's tools, and instructions
    that say who it is and where it may write.

    Args:
        types: The artifact kinds the agent may create.
    """

    types: Sequence[type[Artifact]] = ()
    _: KW_ONLY
    _toolset: FunctionToolset[RuleTools] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._toolset = rule_toolset(self.types)

    @override
    def get_toolset(self) -> FunctionToolset[RuleTools]:
        return self._toolset

    @override
    def get_instructions(self) -> Any:
        return _instructions


def _instructions(ctx: RunContext[RuleTools]) -> str:
    """Who the agent acts for, and what the allowlist in force lets it do."""
    actions = ctx.deps.actions
    allowed = actions.allowlist
    threads = ", ".join(actions.threads) or "none yet"
    lines = [
        f"You act for the rule {actions.rule} in workspace {actions.workspace}, as "
        f"{actions.actor.participant}. Everything you write is attributed to that rule.",
        f"Threads of this run: {threads}.",
        "post_notice informs people and never wakes a thread's agent; "
        + (
            "post_message starts the thread's agent turn."
            if allowed.turns
            else "post_message is posted as a notice: this rule may not start turns."
        ),
    ]
    if allowed.threads != "chain":
        lines.append("You may post in any thread of the workspace.")
    direct = ", ".join(sorted(kind for kind in allowed.direct if actions.writes_directly(kind)))
    lines.append(
        f"Changes to {direct} are made directly; other changes are proposals for people."
        if direct
        else "Every artifact change you make is a proposal for people to review."
    )
    if not allowed.create_threads:
        lines.append("You may not create threads.")
    return "\n".join(lines)
