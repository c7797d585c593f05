"""What the console's HTTP tests share: its token, and consoles of the module's own on real
``relayr console`` processes (:func:`tests.console.consoles.running_console`).

:func:`token_console` holds the token, so a visitor logs in with it to act; :func:`read_only`
has none, and its allowlist and a thread's title hold markup (:data:`SCRIPT`) the pages must
escape. Used by :mod:`tests.console.test_console_sessions`,
:mod:`tests.console.test_console_requests`,
:mod:`tests.console.test_console_pages` and :mod:`tests.console.test_console_process`.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.console.consoles import Console, running_console
from tests.workers import relayr_environment, relayr_here

TOKEN = "console-test-token-0123456789abcdef"
WHERE = "acme/ops"
SCRIPT = "<script>document.title='pwned'</script>"


def environment_of(home: Path, **settings: object) -> dict[str, str]:
    return relayr_environment(home, app="tests.console.console_app:create_console_app", **settings)


@pytest.fixture(scope="module")
def token_console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    home = tmp_path_factory.mktemp("token-console")
    with running_console(environment_of(home, console_token=TOKEN), home) as console:
        yield console


@pytest.fixture(scope="module")
def read_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Console, str]]:
    home = tmp_path_factory.mktemp("read-only-console")
    allowlist = home / "allowlist.toml"
    allowlist.write_text(f'[rules."{SCRIPT}"]\nturns = true\n')
    environment = environment_of(home, allowlist=allowlist)
    thread = relayr_here(environment, "thread", "create", WHERE, "--title", SCRIPT)["id"]
    with running_console(environment, home) as console:
        yield console, thread
