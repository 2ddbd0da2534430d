"""A counting TCP proxy for the PostgreSQL wire protocol.

It relays bytes both ways and counts the statements a client sends (simple-protocol 'Q' and
extended-protocol 'E' messages), so a test can state exactly how many statements a worker sent,
independent of other databases' traffic, autovacuum or statistics flush delays.

``by_text`` keys a statement by its first 60 characters (whitespace collapsed); ``by_query``
keeps the whole text as sent, and :meth:`WireCounter.executed` counts the executions of one
statement given as the application writes it (``%(name)s`` placeholders, as in
kombu_pgjobs/store/sql/*.sql), whatever it starts with.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
from typing import Any

_UNTYPED_REQUESTS = {80877103, 80877104}  # SSLRequest, GSSENCRequest
#: distinct full texts kept in ``by_query`` (statements with literals in them could grow it)
_MAX_QUERIES = 10_000
_PLACEHOLDER = re.compile(r"%(?:\((\w+)\)s|%)")


def wire_text(query: str) -> str:
    """``query`` (psycopg's ``%(name)s`` placeholders) as psycopg sends it: each name numbered
    ``$1``, ``$2``... in the order of its first appearance, ``%%`` as ``%``; whitespace
    collapsed."""
    seen: dict[str, int] = {}

    def number(found: re.Match[str]) -> str:
        if found.group(1) is None:
            return "%"
        return f"${seen.setdefault(found.group(1), len(seen) + 1)}"

    return " ".join(_PLACEHOLDER.sub(number, query).split())


class WireCounter:
    def __init__(self, upstream_host: str = "127.0.0.1", upstream_port: int = 5432) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.statements = 0
        #: statement text (first line of the parsed query, or simple query) -> executions
        self.by_text: dict[str, int] = {}
        #: statement text, whole and as sent (``$1`` placeholders) -> executions
        self.by_query: dict[str, int] = {}
        self._collapsed: dict[str, str] = {}  # by_query's texts, whitespace collapsed
        self.lock = threading.Lock()
        self._closing = False
        self._socks: list[socket.socket] = []
        self._clients: list[socket.socket] = []
        self._kept: set[socket.socket] = set()  # server sides left open by strand()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            self._socks += [client, upstream]
            self._clients.append(client)
            threading.Thread(target=self._client_to_server, args=(client, upstream),
                             daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _recv_exact(sock: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError
            buf += chunk
        return buf

    def _client_to_server(self, src: socket.socket, dst: socket.socket) -> None:
        # prepared statements and portals are the session's own: an Execute on one connection
        # must not be read as the statement another connection bound last
        names: dict[bytes, tuple[str, str]] = {}
        portals: dict[bytes, bytes] = {}
        try:
            while True:  # untyped start-up phase
                head = self._recv_exact(src, 8)
                length, code = struct.unpack("!ii", head)
                body = self._recv_exact(src, length - 8)
                dst.sendall(head + body)
                if code not in _UNTYPED_REQUESTS:
                    break
            while True:
                head = self._recv_exact(src, 5)
                kind = head[:1]
                (length,) = struct.unpack("!i", head[1:])
                body = self._recv_exact(src, length - 4)
                if kind in (b"Q", b"E", b"P", b"B"):
                    self._note(kind, body, names, portals)
                dst.sendall(head + body)
        except (ConnectionError, OSError):
            pass
        finally:
            self._close(src, dst)

    def _note(self, kind: bytes, body: bytes, names: dict[bytes, tuple[str, str]],
              portals: dict[bytes, bytes]) -> None:
        """Count Q and E messages; keep P (statement text) and B (portal -> statement)."""
        with self.lock:
            if kind == b"P":
                name, _, rest = body.partition(b"\0")
                query = rest.split(b"\0", 1)[0]
                names[name] = (query[:80].decode("utf-8", "replace"),
                               query.decode("utf-8", "replace"))
                return
            if kind == b"B":
                portal, _, rest = body.partition(b"\0")
                portals[portal] = rest.split(b"\0", 1)[0]
                return
            self.statements += 1
            if kind == b"Q":
                text = body[:80].decode("utf-8", "replace")
                query = body.split(b"\0", 1)[0].decode("utf-8", "replace")
            else:
                portal = body.partition(b"\0")[0]
                text, query = names.get(portals.get(portal, b""), ("?", "?"))
            key = " ".join(text.split())[:60]
            self.by_text[key] = self.by_text.get(key, 0) + 1
            if query in self.by_query or len(self.by_query) < _MAX_QUERIES:
                self.by_query[query] = self.by_query.get(query, 0) + 1

    def executed(self, query: str) -> int:
        """How often the statement ``query`` was executed: its text as the application passes
        it to psycopg (``%(name)s`` placeholders), matched whole, whitespace aside."""
        wanted = wire_text(query)
        with self.lock:
            sent = list(self.by_query.items())
        total = 0
        for text, n in sent:
            collapsed = self._collapsed.get(text)
            if collapsed is None:
                collapsed = self._collapsed[text] = " ".join(text.split())
            if collapsed == wanted:
                total += n
        return total

    def _relay(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            self._close(src, dst)

    def _close(self, *socks: socket.socket) -> None:
        for s in socks:
            if s in self._kept:
                continue
            try:
                s.close()
            except OSError:
                pass

    def strand(self) -> None:
        """Cut every client connection made so far while its server session lives on (a
        network cut the server has not noticed): the client's socket is shut, the server's is
        left open and silent, so the session keeps its locks and LISTENs until :meth:`close`."""
        clients = set(self._clients)
        self._kept.update(s for s in self._socks if s not in clients)
        for c in clients:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._clients = []

    def count(self) -> int:
        with self.lock:
            return self.statements

    def close(self) -> None:
        self._closing = True
        self._kept.clear()
        self._close(self.server, *self._socks)

    def __enter__(self) -> WireCounter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
