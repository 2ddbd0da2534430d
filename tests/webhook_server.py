"""A real HTTP server for the webhook tests, scripted per path, in a thread of the test process.

``server.script("/flaky", Reply(500), Reply(200))`` answers the first POST to /flaky with a
500 and every later one with a 200 (the last reply repeats). Every request is recorded (path,
headers, raw body, arrival time) before it is answered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b"ok"
    #: seconds to wait before answering (a server that never answers in time)
    delay: float = 0.0


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


class WebhookServer:
    def __init__(self) -> None:
        self.replies: dict[str, list[Reply]] = {}
        self.received: list[Received] = []
        #: requests being answered now, and the most at once, per path
        self.in_flight: dict[str, int] = {}
        self.most_in_flight: dict[str, int] = {}
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                with server.lock:
                    server.received.append(Received(self.path, dict(self.headers.items()),
                                                    body, time.time()))
                    queue = server.replies.get(self.path) or [Reply(404)]
                    reply = queue.pop(0) if len(queue) > 1 else queue[0]
                    now = server.in_flight[self.path] = server.in_flight.get(self.path, 0) + 1
                    server.most_in_flight[self.path] = max(
                        now, server.most_in_flight.get(self.path, 0))
                if reply.delay:
                    time.sleep(reply.delay)
                with server.lock:
                    server.in_flight[self.path] -= 1
                try:
                    self.send_response_only(reply.status)
                    given = {k.lower() for k in reply.headers}
                    if "date" not in given:  # a reply may bring its own (a skewed clock)
                        self.send_header("Date", self.date_time_string())
                    for key, value in reply.headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(len(reply.body)))
                    self.end_headers()
                    self.wfile.write(reply.body)
                except OSError:  # the client gave up (a timeout test)
                    pass

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def script(self, path: str, *replies: Reply) -> str:
        with self.lock:
            self.replies[path] = list(replies)
        return self.url(path)

    def requests(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.path == path]


@contextmanager
def webhook_server() -> Iterator[WebhookServer]:
    server = WebhookServer()
    server.thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
