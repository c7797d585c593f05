"""Calling a rule's action: found by its name, its params validated as the action's model,
called under the rule's timeout, and whatever it did turned into how it ended (:class:`Ended`).

A failure no retry can help is permanent (``unknown_action``, ``invalid_params``,
``forbidden``); any other exception the action raises is the run's failure, to retry by the
rule's policy. Nothing here reads or writes the store: :mod:`relayr.execution.runs` records the end.
"""

import asyncio
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, JsonValue, TypeAdapter, ValidationError
from reflexr.core import Forbidden, InvalidRule, Rule, load_params
from reflexr.workspace import Action, Reaction, RunFailure

from relayr.core import reasons
from relayr.execution.outcomes import Ended

_JSON: TypeAdapter[JsonValue] = TypeAdapter(JsonValue)


def resolve(actions: Mapping[str, Action[Any]], rule: Rule) -> tuple[Action[Any], Any]:
    """Return the rule's action and its params, validated as the action's params model.

    Raises:
        RunFailure: Permanently, ``unknown_action`` if no action has the name (a deploy removed
            it), or ``invalid_params`` if the params do not validate: a retry would fail again.
    """
    action = actions.get(rule.then.action)
    if action is None:
        raise RunFailure(
            f"rule {rule.name} runs {rule.then.action!r}, which is not among the actions",
            reason=reasons.UNKNOWN_ACTION,
            permanent=True,
        )
    model = getattr(action, "params", None)
    declared = model if isinstance(model, type) and issubclass(model, BaseModel) else None
    try:
        return action, load_params(rule, declared)
    except InvalidRule as invalid:
        message = f"rule {rule.name}: " + "; ".join(invalid.problems)
        raise RunFailure(message, reason=reasons.INVALID_PARAMS, permanent=True) from None


async def call(action: Action[Any], reaction: Reaction[Any]) -> Ended:
    """Call the action under the rule's timeout and turn what it did into an outcome."""
    limit = reaction.rule.timeout
    try:
        async with asyncio.timeout(limit.total_seconds() if limit else None):
            output = await action(reaction)
    except TimeoutError:
        return Ended("failed", error=f"the action timed out after {limit}", reason=reasons.TIMEOUT)
    except RunFailure as failure:
        return Ended.failed(failure)
    except Forbidden as refused:  # authorize refused the rule what it did: so would a retry
        return Ended("failed", error=refused.message, reason=reasons.FORBIDDEN, permanent=True)
    except Exception as error:  # an action's failure is the run's, to retry
        return Ended("failed", error=f"{type(error).__name__}: {error}")
    try:
        value = output.model_dump(mode="json") if isinstance(output, BaseModel) else output
        return Ended("succeeded", output=_JSON.validate_python(value))
    except ValidationError:
        return Ended("failed", error="the action returned a value that is not JSON")
