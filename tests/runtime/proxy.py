"""A TCP proxy a test controls: it drops the connections it carries, and refuses new ones.

For faults a broker's clients meet on the network (a connection the server closed, a server
briefly unreachable), made to happen exactly when the test says: the connections through the
proxy are dropped at once, and the next ``refuse`` connection attempts are closed as soon as
they are accepted.
"""

import socket
import threading
from contextlib import suppress

BUFFER_BYTES = 65536


class Proxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``upstream``, in threads of its own."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.refuse = 0
        self.refused = 0
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._carried: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def drop(self, *, refuse: int = 0) -> None:
        """Close every connection carried now; refuse the next ``refuse`` attempts."""
        with self._lock:
            self.refuse = refuse
            carried, self._carried = self._carried, []
        for end in carried:
            with suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def close(self) -> None:
        self.drop()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self.refuse:
                    self.refuse -= 1
                    self.refused += 1
                    client.close()
                    continue
                server = socket.create_connection(("127.0.0.1", self.upstream))
                self._carried += [client, server]
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(source, target), daemon=True).start()


def _pump(source: socket.socket, target: socket.socket) -> None:
    with suppress(OSError):
        while data := source.recv(BUFFER_BYTES):
            target.sendall(data)
    for end in (source, target):
        with suppress(OSError):
            end.close()
