"""An HTTP proxy in front of an S3 API server (moto's) that answers 503 SlowDown to the next ``n``
requests for one object, and forwards everything else as it is: a store that throttles now and
then, for the readers' retries."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class ThrottlingProxy:
    """``endpoint``: ``host:port`` of the proxy. :meth:`fail` arms it; ``failed`` counts the 503s
    answered, ``forwarded`` the requests passed on."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.lock = threading.Lock()
        self.key, self.left, self.failed, self.forwarded = "", 0, 0, 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _handle(self) -> None:
                with proxy.lock:
                    hit = proxy.left > 0 and self.path.split("?")[0].endswith(proxy.key)
                    if hit:
                        proxy.left -= 1
                        proxy.failed += 1
                    else:
                        proxy.forwarded += 1
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if hit:
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOW_DOWN)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = proxy.upstream
                conn.request(self.command, self.path, body=body, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
                self.send_response(reply.status, reply.reason)
                head = self.command == "HEAD"  # its Content-Length is the object's, with no body
                for k, v in reply.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection") and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def fail(self, key: str, n: int) -> None:
        """Answer 503 SlowDown to the next ``n`` requests whose path ends with ``key``."""
        with self.lock:
            self.key, self.left, self.failed = key, n, 0

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
