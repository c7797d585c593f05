"""A target judged: its limit, the figure measured, and the verdict line ``make bench`` prints.

One line per target, the same shape for every benchmark that judges one::

    {"bench": "verdict", "target": "...", "limit": ..., "figure": ..., "verdict": "met"}

A run smaller than the target's own size prints its verdict all the same, marked
``(<size> run: not judged)``: its figure says the benchmark works, not whether the target holds.
"""

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    name: str
    limit: float
    figure: float | None
    higher_is_better: bool = False

    def line(self, size: str) -> dict[str, Any]:
        """The verdict line; ``size`` is ``full`` for a run at the target's size."""
        if self.figure is None:
            verdict = "not measured"
        elif self.higher_is_better:
            verdict = "met" if self.figure >= self.limit else "missed"
        else:
            verdict = "met" if self.figure <= self.limit else "missed"
        return {
            "bench": "verdict",
            "target": self.name,
            "limit": self.limit,
            "figure": self.figure,
            "verdict": verdict + ("" if size == "full" else f" ({size} run: not judged)"),
        }


def divided(top: float | None, bottom: float | None) -> float | None:
    """``top / bottom`` to two decimals, or None when either is missing (or ``bottom`` is 0)."""
    if top is None or not bottom:
        return None
    return round(top / bottom, 2)
