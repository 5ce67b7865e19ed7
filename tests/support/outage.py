"""An S3 endpoint that a test can take down and bring back: a loopback TCP proxy in front of moto.

Holds ``OutageProxy``: it listens on its own port on 127.0.0.1 and relays every connection, byte
for byte, to the moto server behind it (whose state, the buckets and objects, lives on). ``down``
does what a restarting or crashed endpoint does to its clients: the open connections are cut
(a request in flight gets no answer; a pooled connection is found closed) and new ones are
refused (nothing listens on the port); ``up`` listens on the same port again. Restarting moto
itself would lose every object, since moto keeps them in memory.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from tests.support.cluster import HOST, free_port

_CHUNK = 1 << 16


class OutageProxy:
    """Relays 127.0.0.1:``port`` to ``upstream`` (``http://127.0.0.1:PORT``) while up."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
        self._upstream = (host, int(port))
        self.port = free_port()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self.up()

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    def up(self) -> None:
        """Listen again (on the same port) and relay new connections."""
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((HOST, self.port))
            listener.listen(128)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="outage-accept", daemon=True).start()

    def down(self) -> None:
        """Refuse new connections and cut the open ones."""
        with self._lock:
            listener, self._listener = self._listener, None
            cut, self._open = self._open, set()
        if listener is not None:
            _shut(listener)  # wakes the accept() blocked on it
            listener.close()
        for sock in cut:
            _shut(sock)  # wakes its relay threads, which close it

    @contextlib.contextmanager
    def running(self) -> Iterator[OutageProxy]:
        try:
            yield self
        finally:
            self.down()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # shut down by down()
                return
            try:
                server = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    client.close()
                    server.close()
                    continue
                self._open |= {client, server}
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._relay, args=(src, dst), name="outage-relay", daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(_CHUNK):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            # Either side closing ends the whole connection, as it would without the proxy.
            for sock in (src, dst):
                _shut(sock)
                with self._lock:
                    self._open.discard(sock)
                sock.close()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
