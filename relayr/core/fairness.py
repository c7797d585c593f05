"""Fair hand-out of due runs between workspaces and tenants: a pure queue (ADR-0093).

One lane per workspace, in the order runs came due. :meth:`FairQueue.hand_out` sends a
workspace's next message only while fewer than ``per_workspace`` of its messages wait in the
broker, to tenants by virtual time (a message costs ``1 / weight``; a tenant idle until now
joins at the least-served active tenant's time) and within a tenant to its workspaces in turn.
It withholds nothing else, so a lone busy workspace gets a message each time one is taken. A
run marked ``alone`` leaves in a message of its own. A message of a backlog is marked
``behind``: the broker delivers messages of workspaces with nothing else waiting first.
"""

import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final

type Workspace = tuple[str, str]
"""A workspace, as ``(tenant_id, workspace_id)``."""

DEFAULT_WEIGHT: Final = 1.0


@dataclass(frozen=True)
class Message[T]:
    """Runs to send together: one workspace's, in lane order."""

    workspace: Workspace
    items: tuple[T, ...]
    behind: bool = False
    """Whether it is part of a backlog (its workspace has another message in the broker, or
    more items wait here): it goes behind messages of workspaces that have nothing else
    waiting, which the broker delivers first."""


@dataclass
class _Lane[T]:
    items: OrderedDict[Hashable, tuple[T, bool]] = field(default_factory=OrderedDict)
    """Waiting items by key, in the order they entered, each with whether it goes alone: an
    ordered dict, whose first item is found at once however many were taken before it (a
    plain dict skips over the slots of the items taken, so a lane of thousands drained from
    the front costs the square of its length)."""


class FairQueue[T]:
    """Due runs waiting to be handed out, one lane per workspace.

    Args:
        per_workspace: How many messages of one workspace may wait in the broker at once.
        weights: A tenant's share relative to others (default 1.0 each).
        batch: The most items one message carries.
        spread: Into how many messages at least a lane's items are split (each up to
            ``batch``), so a handful still reaches several workers.
    """

    def __init__(
        self,
        *,
        per_workspace: int,
        weights: Mapping[str, float] | None = None,
        batch: int,
        spread: int,
    ) -> None:
        if per_workspace < 1 or batch < 1 or spread < 1:
            raise ValueError("per_workspace, batch and spread must be at least 1")
        self._per_workspace = per_workspace
        self._weights = dict(weights or {})
        self._batch = batch
        self._spread = spread
        self._lanes: dict[Workspace, _Lane[T]] = {}
        self._where: dict[Hashable, Workspace] = {}
        self._tenant_time: dict[str, float] = {}
        self._turns: dict[str, deque[str]] = {}
        """Each tenant's workspaces with waiting items, the next to serve first."""

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._where

    def waiting(self, workspace: Workspace) -> int:
        """How many items of ``workspace`` wait here."""
        lane = self._lanes.get(workspace)
        return 0 if lane is None else len(lane.items)

    def __iter__(self) -> Iterator[Hashable]:
        """Every waiting item's key (a copy: the queue may change meanwhile)."""
        return iter(list(self._where))

    def add(self, workspace: Workspace, key: Hashable, item: T, *, alone: bool = False) -> None:
        """Put an item at the end of its workspace's lane; one already waiting under ``key``
        keeps its place and takes the new value."""
        lane = self._lanes.get(workspace)
        if lane is None:
            lane = self._lanes[workspace] = _Lane()
        if key in lane.items:
            lane.items[key] = (item, alone)
            return
        tenant, name = workspace
        if tenant not in self._turns:  # idle until now: it joins the least-served's time
            floor = min((self._tenant_time[t] for t in self._turns), default=0.0)
            self._tenant_time[tenant] = max(self._tenant_time.get(tenant, 0.0), floor)
        if not lane.items:
            self._turns.setdefault(tenant, deque()).append(name)
        lane.items[key] = (item, alone)
        self._where[key] = workspace

    def remove(self, key: Hashable) -> None:
        """Forget an item (it is no longer due); nothing if it is not waiting."""
        workspace = self._where.pop(key, None)
        if workspace is None:
            return
        lane = self._lanes[workspace]
        del lane.items[key]
        if not lane.items:
            self._retire(workspace)

    def hand_out(self, in_broker: Mapping[Workspace, int]) -> list[Message[T]]:
        """The messages to send now, in the order to send them.

        ``in_broker`` says how many messages of each workspace wait in the broker already
        (missing: none). Each message handed out counts as waiting from then on.
        """
        counted = {workspace: in_broker.get(workspace, 0) for workspace in self._lanes}
        sizes = {  # a lane's messages of one hand-out share its size
            workspace: min(self._batch, max(1, math.ceil(len(lane.items) / self._spread)))
            for workspace, lane in self._lanes.items()
        }
        sent: list[Message[T]] = []
        while True:
            tenant = self._next_tenant(counted)
            if tenant is None:
                return sent
            turns = self._turns[tenant]
            for _ in range(len(turns)):
                name = turns[0]
                turns.rotate(-1)
                workspace = (tenant, name)
                if counted[workspace] < self._per_workspace:
                    break
            sent.append(self._take(workspace, sizes[workspace], behind=counted[workspace] > 0))
            counted[workspace] += 1
            self._tenant_time[tenant] += 1.0 / self._weights.get(tenant, DEFAULT_WEIGHT)

    def _next_tenant(self, counted: Mapping[Workspace, int]) -> str | None:
        """The tenant with the least virtual time among those with a workspace that may send."""
        chosen: str | None = None
        for tenant, turns in self._turns.items():
            if not any(counted[(tenant, name)] < self._per_workspace for name in turns):
                continue
            if chosen is None or self._tenant_time[tenant] < self._tenant_time[chosen]:
                chosen = tenant
        return chosen

    def _take(self, workspace: Workspace, size: int, *, behind: bool) -> Message[T]:
        lane = self._lanes[workspace]
        taken: list[T] = []
        while lane.items:
            key = next(iter(lane.items))
            item, alone = lane.items[key]
            if alone and taken:
                break
            taken.append(item)
            del lane.items[key]
            del self._where[key]
            if alone or len(taken) >= size:
                break
        if lane.items:
            return Message(workspace, tuple(taken), behind=True)
        self._retire(workspace)
        return Message(workspace, tuple(taken), behind=behind)

    def _retire(self, workspace: Workspace) -> None:
        tenant, name = workspace
        del self._lanes[workspace]
        turns = self._turns.get(tenant)
        if turns is not None and name in turns:
            turns.remove(name)
            if not turns:
                del self._turns[tenant]


def parse_weights(weights: Mapping[str, object]) -> dict[str, float]:
    """Tenants' weights, checked: each a positive, finite number.

    Raises:
        ValueError: Naming the first tenant whose weight is not one.
    """
    checked: dict[str, float] = {}
    for tenant, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"tenant {tenant!r}: weight {weight!r} is not a number")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"tenant {tenant!r}: weight {weight!r} must be above 0 and finite")
        checked[tenant] = float(weight)
    return checked
