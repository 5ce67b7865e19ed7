"""An S3 endpoint that throttles: an HTTP proxy on loopback in front of moto that answers the
first PUT of every object with ``503 SlowDown``, as S3 does to a prefix over its request rate.

Holds ``SlowDownProxy``: every request is relayed to moto as it came (method, path, headers,
body: moto does not check signatures, so the client's stay valid), except that the first PUT
to each key gets S3's SlowDown error instead; the next PUT of that key goes through. So every
write must back off and send again, and a job that survives it has done so for each object.
``refused`` counts the 503s served.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from tests.support.cluster import HOST

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class SlowDownProxy:
    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        self._upstream = (target.hostname or HOST, target.port or 80)
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self.refused = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet: moto keeps the request log
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.command == "PUT" and proxy._first_put(self.path.split("?", 1)[0]):
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                conn = http.client.HTTPConnection(*proxy._upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                finally:
                    conn.close()
                self.send_response(answer.status, answer.reason)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _relay

        self._server = ThreadingHTTPServer((HOST, 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="slowdown-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _first_put(self, key: str) -> bool:
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            self.refused += 1
            return True

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
