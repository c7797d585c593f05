"""A Redis of the test's own: a restart must not touch other tests' messages.

kombu's ``unacked`` hash is global to a Redis database, so a short visibility timeout on the
shared Redis would redeliver every other test's in-flight messages, and a restart would drop
their connections. Each scenario starts ``redis-server`` on a free port and folder instead.

A free port is only free when it was looked at: another process may bind it before
``redis-server`` does. So the server counts as started only once the process it started is
running and the Redis answering on the port says it is that process (``INFO server``'s
``process_id``); a first start whose port was taken tries another one. A restart keeps its port
(the workers' URLs name it): if it was taken meanwhile, the restart fails, naming it, and
nothing is done to the server that took it.
"""

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import redis

from tests.faults.constants import POLL_S, REDIS_START_S
from tests.services import KOMBU, free_port

START_ATTEMPTS: Final = 5
"""How many free ports a first start tries: one is taken between the look and the bind only
when another process binds ports at that very moment, so five never all are."""


class PortTaken(Exception):
    """Raised when what listens on the server's port is not the process it started."""


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

    def start(self) -> None:
        """Start the server on a free port (another one if its port turns out taken)."""
        for attempt in range(START_ATTEMPTS):
            if attempt:
                self.port = free_port()
            try:
                self._start()
                return
            except PortTaken:
                continue
        raise AssertionError(f"redis-server: {START_ATTEMPTS} free ports were all taken first")

    def _start(self, timeout_s: float = REDIS_START_S) -> None:
        """Start the server on :attr:`port` and wait until it is the one answering there.

        Raises:
            PortTaken: If the port was bound by another process first (the server exited
                unable to bind it, or another Redis answers there).
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        log = _Log(self.folder / "redis.log")
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
            str(log.path),
        ]
        process = subprocess.Popen(command, start_new_session=True)
        self.process = process
        client = self.client()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                # the process first: while it runs, what answers could still be someone else
                if process.poll() is not None:
                    self.process = None
                    text = log.since_start()
                    if "Address already in use" in text:
                        raise PortTaken(f"port {self.port} is taken:\n{text}")
                    raise AssertionError(f"redis-server exited on port {self.port}:\n{text}")
                answering = _answering_pid(client)
                if answering == process.pid and _ready(client):
                    return
                if answering not in (None, process.pid):
                    self.kill()
                    raise PortTaken(f"port {self.port} is served by process {answering}")
                if time.monotonic() > deadline:
                    text = log.since_start()
                    self.kill()
                    raise AssertionError(
                        f"redis-server did not start on port {self.port} in {timeout_s} s:\n{text}"
                    )
                time.sleep(POLL_S)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server, as a crashed host would."""
        if self.process is not None:
            with suppress(ProcessLookupError):
                self.process.kill()
            self.process.wait()
            self.process = None

    def restart(self) -> None:
        """Start the server again on its AOF and its port, after :meth:`kill`.

        Raises:
            AssertionError: If its port was taken meanwhile (the workers' URLs name it).
        """
        try:
            self._start()
        except PortTaken as taken:
            raise AssertionError(f"redis-server cannot restart: {taken}") from None
        self.restarts += 1

    def queued(self, queue: str) -> int:
        """How many messages wait in ``queue`` (kombu keeps a queue as a Redis list, and one
        more per priority below the highest)."""
        client = self.client()
        try:
            lists = [queue, *(f"{queue}{KOMBU.sep}{step}" for step in KOMBU.priority_steps[1:])]
            return sum(int(client.llen(name)) for name in lists)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
        self.kill()


def _answering_pid(client: redis.Redis) -> int | None:
    """The process id of the Redis answering ``client``'s port, or None if none answers."""
    try:
        return int(client.info("server")["process_id"])
    except redis.RedisError:
        return None


def _ready(client: redis.Redis) -> bool:
    """Whether the server answers a ping: INFO answers while it still loads its AOF, a ping
    only once it serves."""
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


class _Log:
    """The server's log file, which a restart appends to: what one start wrote is read apart."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._start = path.stat().st_size if path.exists() else 0

    def since_start(self) -> str:
        if not self.path.exists():
            return ""
        with self.path.open("rb") as file:
            file.seek(self._start)
            return file.read().decode(errors="replace")


@contextmanager
def private_redis(folder: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(folder)
    server.start()
    try:
        yield server
    finally:
        server.stop()
