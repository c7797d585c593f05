"""A Redis of the test's own: a restart must not touch other tests' messages.

kombu's ``unacked`` hash is global to a Redis database, so a short visibility timeout on the
shared Redis would redeliver every other test's in-flight messages, and a restart would drop
their connections. Each scenario starts ``redis-server`` on a free port and folder instead.
"""

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.faults.constants import POLL_S, REDIS_START_S


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class PrivateRedis:
    """A ``redis-server`` with AOF on (fsync at every write), on its own port and folder.

    ``appendfsync always``: a write Redis acknowledged survives a SIGKILL of the server, as in
    the deployment's compose file (AOF, ``noeviction``); what a restart may lose is only what
    the broker's clients had in flight.
    """

    folder: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=0.5)

    def start(self, timeout_s: float = REDIS_START_S) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        command = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.folder),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            "--logfile",
            str(self.folder / "redis.log"),
        ]
        self.process = subprocess.Popen(command, start_new_session=True)
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.folder / "redis.log").read_text(errors="replace")
                self.kill()
                raise AssertionError(f"redis-server did not start on {self.port}:\n{log}")
            time.sleep(POLL_S)
        client.close()

    def kill(self) -> None:
        """SIGKILL the server, as a crashed host would."""
        if self.process is not None:
            with suppress(ProcessLookupError):
                self.process.kill()
            self.process.wait()
            self.process = None

    def restart(self) -> None:
        """Start the server again on its AOF, after :meth:`kill`."""
        self.start()
        self.restarts += 1

    def queued(self, queue: str) -> int:
        """How many messages wait in ``queue`` (kombu keeps a queue as a Redis list)."""
        client = self.client()
        try:
            return int(client.llen(queue))
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
        self.kill()


@contextmanager
def private_redis(folder: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(folder)
    server.start()
    try:
        yield server
    finally:
        server.stop()
