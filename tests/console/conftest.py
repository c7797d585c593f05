"""The console's tests share two consoles on real storage: one with a token, one read-only."""

from tests.console.console_http import read_only as read_only
from tests.console.console_http import token_console as token_console
