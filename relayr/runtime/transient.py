"""Transient faults: which errors may pass if the same step is tried again, and the bounded retry.

A dropped connection, SQLite's ``database is locked`` or a briefly unreachable broker is
transient; a constraint, a refusal or a programming error is not. Every step retried here is
safe to repeat, so a transient fault is retried a few times within the attempt and never spends
one of the rule's retries.
"""

from collections.abc import Awaitable, Callable
from typing import Final

from kombu.exceptions import OperationalError as BrokerUnreachable
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

TRIES: Final = 3
"""How often one step is tried when it fails transiently. Three tries ride out a dropped
connection (the pool connects again at once) or a SQLite lock another process holds (the
driver itself waits for it, :data:`relayr.runtime.application.SQLITE_LOCK_TIMEOUT_S`), while a
database or broker that is down fails the step within a fraction of a second."""

BACKOFF_S: Final = (0.05, 0.5)
"""The first wait between tries of a step, and the bound on any wait: each wait doubles, so
three tries wait 0.05 s, then 0.1 s."""

WAIT: Final = wait_exponential(multiplier=BACKOFF_S[0], max=BACKOFF_S[1])
"""tenacity's wait after the ``n``-th try: ``BACKOFF_S[0] * 2 ** (n - 1)``, at most
``BACKOFF_S[1]`` (a multiplier of 1 with ``BACKOFF_S[0]`` as a floor made every wait the
bound)."""


def is_transient(error: BaseException) -> bool:
    """Whether an error may pass if the same step is tried again.

    A lost, refused or timed-out connection (to the database or the broker), SQLite's
    ``database is locked`` and an unreachable broker are; a constraint, an encoding or a
    programming error is not, and neither is anything that is not the database's or the
    broker's.
    """
    if isinstance(error, DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(
        error,
        OperationalError | InterfaceError | ConnectionError | TimeoutError | BrokerUnreachable,
    )


def is_storage_error(error: BaseException) -> bool:
    """Whether an error is the storage's own (the database's, through SQLAlchemy), transient or
    not: what a write that outlasted its retries fails with, as ``storage_unavailable``."""
    return isinstance(error, SQLAlchemyError) or is_transient(error)


async def retried[T](step: Callable[[], Awaitable[T]]) -> T:
    """Run ``step``, trying it again after a transient failure, at most :data:`TRIES` times."""
    async for attempt in AsyncRetrying(
        stop=stop_after_attempt(TRIES),
        wait=WAIT,
        retry=retry_if_exception(is_transient),
        reraise=True,
    ):
        with attempt:
            return await step()
    raise AssertionError("unreachable: tenacity reraises the last error")  # pragma: no cover
