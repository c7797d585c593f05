"""What an application says about its inbound side: which workspaces are followed, and how.

:class:`Inbound` is ``Application.inbound``. Left out, relayr follows every artifactr workspace
of every tenant reflexr's storage knows (the tenants where a rule can run), with the default
projections. This module imports neither library, so :mod:`relayr.runtime.application` can name it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relayr.follow.projections import Projection
    from relayr.ledger.port import WorkspaceKey

type AfterPublish = Callable[[WorkspaceKey, Sequence[int]], Awaitable[None]]
"""Awaited after a batch is published and before the cursor moves past it, with the batch's
workspace and artifactr seqs."""


@dataclass(frozen=True)
class Inbound:
    """Where an application's followers read artifactr, and how they turn it into events.

    Attributes:
        workspaces: The workspaces to follow, as ``WorkspaceKey(tenant, workspace)``. None (the
            default): every artifactr workspace of every tenant that reflexr's storage knows
            or :attr:`tenants` names. Empty: follow nothing.
        tenants: Tenants whose artifactr workspaces are followed even before reflexr's storage
            knows them (a tenant's first event arrives through the bridge). Only with
            ``workspaces=None``.
        projections: Projections by artifactr event type, added to the defaults or replacing
            them (:data:`relayr.follow.projections.PROJECTIONS`).
        after_publish: Awaited after each batch is published and before the cursor moves: to
            count batches, or for a test that stops a follower there.
    """

    workspaces: Collection[WorkspaceKey] | None = None
    tenants: Collection[str] = ()
    projections: Mapping[str, Projection] = field(default_factory=dict)
    after_publish: AfterPublish | None = None
