"""Derived ids: every write a run makes gets an id that its retries compute again.

An id is a prefix and a SHA-256 digest of what makes the write itself (run, segment, operation,
subject and content) and how many identical writes the attempt made before it. The same writes
on any retry get the same ids, so artifactr refuses the second commit of each and a retried task
makes each effect once (ADR-0020, ADR-0027). Pure.
"""

import hashlib
import json
from collections import Counter
from collections.abc import Mapping
from typing import Any, Final, Literal

type Prefix = Literal["msg", "thr", "prp", "art"]

DIGITS: Final = 16
"""Hex digits kept of the SHA-256: 64 bits, so a collision among a workspace's ids is
astronomically unlikely, and ids stay as short as artifactr's own."""


def digest(text: str) -> str:
    """The SHA-256 of ``text`` in hex: what an id carries of a write's content."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def canonical(data: Mapping[str, Any]) -> str:
    """JSON data as one text, keys sorted: what an id's digest of a write's data is made over."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def derive_id(
    prefix: Prefix,
    *,
    run_id: str,
    segment: int,
    operation: str,
    subject: tuple[str, ...],
    ordinal: int,
) -> str:
    """Return ``<prefix>_<16 hex>`` for one write of a run.

    Args:
        prefix: What the id names: a message, a thread, a proposal or an artifact.
        run_id: The run, whose every attempt derives the same ids.
        segment: How many checkpoints the run had saved when it wrote.
        operation: What the write does, such as ``post_message`` or ``edit_artifact``.
        subject: What the write is: its thread and content digest, its artifact and path.
        ordinal: How many identical writes (same segment, operation and subject) the attempt
            made before this one.
    """
    material = json.dumps(
        [run_id, segment, operation, list(subject), ordinal],
        ensure_ascii=True,
        separators=(",", ":"),
    )
    return f"{prefix}_{digest(material)[:DIGITS]}"


class IdDeriver:
    """Derives the ids of one attempt's writes, counting identical writes as they are made.

    One per attempt: a fresh attempt counts from zero again, so its writes, made in the same
    order, get the ids the earlier attempt's got.
    """

    def __init__(self, run_id: str) -> None:
        self._run_id = run_id
        self._made: Counter[tuple[int, str, tuple[str, ...]]] = Counter()

    def next(
        self, prefix: Prefix, *, segment: int, operation: str, subject: tuple[str, ...]
    ) -> str:
        """Return the id of the next write of this kind, and count it."""
        (made,) = self.next_ids((prefix,), segment=segment, operation=operation, subject=subject)
        return made

    def next_ids(
        self,
        prefixes: tuple[Prefix, ...],
        *,
        segment: int,
        operation: str,
        subject: tuple[str, ...],
    ) -> tuple[str, ...]:
        """Return one id per prefix for the next write of this kind, counted once.

        For a write that names two things, such as a proposal to create an artifact.
        """
        key = (segment, operation, subject)
        ordinal = self._made[key]
        self._made[key] += 1
        return tuple(
            derive_id(
                prefix,
                run_id=self._run_id,
                segment=segment,
                operation=operation,
                subject=subject,
                ordinal=ordinal,
            )
            for prefix in prefixes
        )
