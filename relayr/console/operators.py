"""Who acts in the console: each token an operator logs in with, and the name it acts under.

``RELAYR_CONSOLE_TOKEN`` is one shared token, its holder named ``console``; the operators' own
tokens are a TOML file (``RELAYR_CONSOLE_TOKENS``), one ``name = "token"`` line each, read when
the console starts (ADR-0113). A file with any problem is refused whole, naming the operator
and what is wrong, never the token: the console does not start with half its operators.
"""

import hmac
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from relayr.ops.runs import operator
from relayr.settings import CONSOLE_TOKEN_MIN_CHARS

SHARED_TOKEN_NAME: Final = "console"
"""The name of ``RELAYR_CONSOLE_TOKEN``'s holder, as actions record it (without an operator
header)."""


class InvalidTokens(ValueError):
    """Raised when the operators' tokens file cannot be read or holds a bad entry."""


def load_tokens(path: Path) -> dict[str, str]:
    """The operators' tokens in ``path``, by name.

    Raises:
        InvalidTokens: Naming the file and the first problem: unreadable, not TOML, a value
            that is not a string, a bad name or one given twice, a token shorter than the
            console accepts, a token two names share, or no operator at all.
    """
    try:
        entries = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise InvalidTokens(f"{path}: cannot be read: {error.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise InvalidTokens(f"{path}: not TOML: {error}") from None
    if not entries:
        raise InvalidTokens(f'{path}: names no operator; write one name = "token" line each')
    tokens: dict[str, str] = {}
    for name, token in entries.items():
        where = f"{path}: operator {name!r}"
        if not isinstance(token, str):
            raise InvalidTokens(f'{where}: give the token as a string, name = "token"')
        try:
            operator(name, via="console")
        except ValueError as error:
            raise InvalidTokens(f"{where}: {error}") from None
        if name.strip() == SHARED_TOKEN_NAME:
            raise InvalidTokens(f"{where}: the name is RELAYR_CONSOLE_TOKEN's holder's")
        if name.strip() in tokens:
            raise InvalidTokens(f"{where}: the name is given twice")
        if len(token) < CONSOLE_TOKEN_MIN_CHARS:
            raise InvalidTokens(
                f"{where}: use a token of at least {CONSOLE_TOKEN_MIN_CHARS} characters"
            )
        shared = [other for other, known in tokens.items() if known == token]
        if shared:
            raise InvalidTokens(f"{where}: the token is {shared[0]!r}'s too; give each its own")
        tokens[name.strip()] = token
    return tokens


def holder(tokens: Mapping[str, str], given: str) -> str | None:
    """The name of the token ``given`` is, or None; every token is compared in constant time,
    so the answer's timing tells nothing of which one came close."""
    found = None
    for name, token in tokens.items():
        if hmac.compare_digest(given.encode(), token.encode()):
            found = name
    return found
