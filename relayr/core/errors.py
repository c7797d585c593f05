"""relayr's errors: one root, grouped by family, each with a stable ``code`` for machines.

Messages are lower case and name the ids involved, so a log line or a CLI error says what is wrong
without a stack trace. A refusal of a rule's write is not one of these: it is a reflexr
``RunFailure`` (see :mod:`relayr.execution.actions`), because reflexr's retry policy decides what
happens to the run.
"""

from dataclasses import dataclass


class RelayrError(Exception):
    """Raised when relayr refuses something; ``code`` says what, ``message`` says why."""

    code = "relayr_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input: where (a key path, and a line when known) and what."""

    key: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.key} (line {self.line})" if self.line is not None else self.key
        return f"{where}: {self.message}"


class InvalidAllowlist(RelayrError):
    """Raised when an allowlist file cannot be used; ``problems`` lists every fault with its key.

    An invalid file is refused whole: never a partial or widened allowlist.
    """

    code = "invalid_allowlist"

    def __init__(self, source: str, problems: "list[Problem] | tuple[Problem, ...]") -> None:
        self.source = source
        self.problems = tuple(problems)
        lines = "; ".join(str(problem) for problem in self.problems)
        super().__init__(f"allowlist {source} is invalid: {lines}")


class InvalidEmission(RelayrError):
    """Raised when an emission record does not validate; ``code`` is the named rejection."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class InvalidSettings(RelayrError):
    """Raised when the environment's ``RELAYR_*`` settings cannot be used."""

    code = "invalid_settings"


class InvalidApplication(RelayrError):
    """Raised when ``RELAYR_APP`` names no factory, or the factory returns unusable pieces."""

    code = "invalid_application"


class InvalidTask(RelayrError):
    """Raised when a task message's arguments are malformed; it is dropped, never retried."""

    code = "invalid_task"


class BrokerUnavailable(RelayrError):
    """Raised when the broker refused a message after its bounded retries (it is down or
    unreachable); ``broker`` names it, passwords redacted."""

    code = "broker_unavailable"

    def __init__(self, broker: str, cause: BaseException, *, tries: int) -> None:
        self.broker = broker
        self.tries = tries
        super().__init__(
            f"broker {broker} is unreachable after {tries} tries: {type(cause).__name__}: {cause}"
        )
