"""Whether the last try of a step committed, when a fault hid it.

A fault during COMMIT (a connection lost as PostgreSQL committed) may hide a commit that took
effect, so a step tried again after a transient fault (:mod:`relayr.runtime.transient`) would meet
its own work as if another executor had done it. The tries of one step of
:mod:`relayr.execution.attempts` share a :class:`HiddenCommits`: each notes the runs it is about to
save, and the next reads them back first; found as saved, they mean that try committed whole, and
its result stands.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from reflexr.core import Run
from reflexr.workspace import Transaction

type _Mark = tuple[str, int, int, datetime]


def _mark(run: Run) -> _Mark:
    return (run.status, run.epoch, run.attempts, run.updated_at)


@dataclass
class HiddenCommits[T]:
    """The tries of one step, and what the last of them was about to commit.

    Every change a step makes moves a run to another status at that try's own ``now``, which
    no one else writes, so a run that reads back exactly as the last try saved it (status,
    epoch, attempts, ``updated_at``) was saved by that try: its transaction committed whole,
    and its result stands. A try that finds nothing of the last one's in the store acts
    afresh, as that one rolled back.
    """

    saved: dict[str, Run] = field(default_factory=dict)
    result: T | None = None

    def about_to_commit(self, runs: Iterable[Run], result: T) -> None:
        self.saved = {run.id: run for run in runs}  # the last version of each run
        self.result = result

    async def committed(self, transaction: Transaction) -> T | None:
        """The last try's result if its commit took effect, else None."""
        for saved in self.saved.values():
            stored = await transaction.run(saved.id)
            if stored is not None and _mark(stored) == _mark(saved):
                return self.result
        return None
