"""Who may read and change things from the dashboard, how a browser proves it, and what a
wrong guess costs.

**Levels.** Anonymous, ``read``, ``write``. Pages are open to anyone who reaches the app
unless it has a read token: then every page needs the read token or the write token. Actions
need write mode and the write token. A script shows a token as ``Authorization: Bearer
TOKEN``; a browser signs in with it at ``/login``, which opens a session.

**Sessions** are server-side: the cookie holds a random 256-bit id, and this process keeps,
under its hash, the session's level, its CSRF token, and when it was opened and last used. A
session ends at sign-out (the id is forgotten, so a copied cookie is worth nothing after it),
after :data:`SESSION_SECONDS`, after :data:`IDLE_SECONDS` unused, when the tokens are rotated
(:meth:`Guard.rotate`), and when the process stops. Cookies are HttpOnly and SameSite=Strict,
and Secure when the request came over HTTPS (behind a proxy: its ``X-Forwarded-Proto``, when
the proxy is trusted) or the app was told to always set it.

**CSRF.** A signed-in browser's forms carry its session's CSRF token: a random value kept with
the session, so a token taken from any other page (an anonymous one, another browser's) does
not pass, and a cookie planted from a sibling domain names no session. The sign-in form, which
has no session yet, carries an HMAC of a random per-browser nonce (its own cookie) under the
app's secret.

**Guessing.** Every wrong token (a sign-in, a bearer header) counts against the client's
address; after :data:`FREE_FAILURES` in a row each further try must wait (1 s, 2 s, 4 s... at
most :data:`MAX_WAIT`) and is answered 429 unchecked until then; a right token clears the
count. **Tokens** must be at least :data:`MIN_TOKEN` printable ASCII characters and not
guessable by a simple estimate (:func:`check_token`).

Every value that comes from a cookie or a form is checked for shape (ASCII, length) before it
is used, and compared as bytes: a malformed or non-ASCII cookie is no cookie, never an error.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ...errors import DashboardTokenRequired, DashboardWeakToken

__all__ = ["CSRF_COOKIE", "IDLE_SECONDS", "MIN_TOKEN", "SESSION_COOKIE", "SESSION_SECONDS",
           "Guard", "Session", "Throttle", "check_token"]

CSRF_COOKIE = "pgjobs_csrf"
SESSION_COOKIE = "pgjobs_session"
#: how long a sign-in lasts at most
SESSION_SECONDS = 12 * 3600
#: a session unused this long ends
IDLE_SECONDS = 2 * 3600
#: the shortest token accepted
MIN_TOKEN = 16
MAX_TOKEN = 1024
#: a token's estimated strength must reach this (length x log2 of its distinct characters)
MIN_TOKEN_BITS = 64
MIN_DISTINCT = 8
#: wrong tokens in a row from one address before each further try waits
FREE_FAILURES = 5
#: the longest wait between two tries (seconds)
MAX_WAIT = 300.0
#: addresses the throttle remembers, and sessions kept, at most (memory stays bounded)
MAX_CLIENTS = 10_000
MAX_SESSIONS = 10_000

_SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{43}$")     # secrets.token_urlsafe(32)
_NONCE = re.compile(r"^[A-Za-z0-9_-]{32}$")          # secrets.token_urlsafe(24)
_PRINTABLE = re.compile(r"^[\x21-\x7e]+$")


def check_token(token: str | None, what: str = "write token") -> str:
    """A token fit to guard the dashboard, or :class:`DashboardTokenRequired` (none, or
    shorter than 16) / :class:`DashboardWeakToken` (``PGJ-436``: not printable ASCII, or
    guessable: fewer than 8 distinct characters, or under 64 bits by length x log2(distinct
    characters) — 16 identical characters, ``0123456789012345``). The error never repeats the
    token."""
    make = "make one with: python -c 'import secrets; print(secrets.token_urlsafe(24))'"
    if not token or len(token) < MIN_TOKEN:
        raise DashboardTokenRequired(
            f"the dashboard's {what} must be at least {MIN_TOKEN} characters "
            f"(got {len(token or '')}): {make}")
    if len(token) > MAX_TOKEN or not _PRINTABLE.match(token):
        raise DashboardWeakToken(
            f"the dashboard's {what} must be at most {MAX_TOKEN} printable ASCII characters, "
            f"without spaces: {make}")
    distinct = len(set(token))
    if distinct < MIN_DISTINCT or len(token) * math.log2(distinct) < MIN_TOKEN_BITS:
        raise DashboardWeakToken(
            f"the dashboard's {what} is too easy to guess ({len(token)} characters, "
            f"{distinct} distinct): {make}")
    return token


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("ascii")).digest()


def _same(expected: str, given: object) -> bool:
    """Constant-time equality of a value we made and one that came in (any text: compared
    as UTF-8 bytes, so a non-ASCII value is a mismatch, never an error)."""
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(expected.encode("utf-8"), given.encode("utf-8", "replace"))


@dataclass
class Session:
    """One signed-in browser: its level, its CSRF token, when it was opened and last used."""

    level: str  # read | write
    csrf: str
    opened: float
    seen: float


@dataclass
class Throttle:
    """Wrong tokens per client address, and how long the next try must wait."""

    clock: Callable[[], float] = time.monotonic
    #: address -> (wrong tokens in a row, when the next try may come)
    _clients: OrderedDict[str, tuple[int, float]] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def wait(self, client: str) -> float:
        """Seconds before ``client`` may try a token again (0: now)."""
        with self._lock:
            entry = self._clients.get(client)
            return max(0.0, entry[1] - self.clock()) if entry else 0.0

    def fail(self, client: str) -> float:
        """Count a wrong token; the wait it earns."""
        with self._lock:
            failures = self._clients.pop(client, (0, 0.0))[0] + 1
            wait = 0.0 if failures < FREE_FAILURES else \
                min(MAX_WAIT, 2.0 ** (failures - FREE_FAILURES))
            self._clients[client] = (failures, self.clock() + wait)
            while len(self._clients) > MAX_CLIENTS:
                self._clients.popitem(last=False)  # the longest untouched
            return wait

    def succeed(self, client: str) -> None:
        with self._lock:
            self._clients.pop(client, None)


class Guard:
    """The write switch, the tokens, the sessions and the throttle of one dashboard."""

    def __init__(self, *, write: bool, token: str | None, read_token: str | None = None,
                 secret: bytes | None = None, clock: Callable[[], float] = time.time) -> None:
        self.write = write
        self.clock = clock
        self.throttle = Throttle()
        self._lock = threading.Lock()
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()
        self._given_secret = secret
        self._set(token, read_token)

    @classmethod
    def make(cls, *, write: bool, token: str | None, read_token: str | None = None,
             secret: bytes | None = None) -> Guard:
        if write:
            check_token(token, "write token")
        if read_token is not None:
            check_token(read_token, "read token")
            if token is not None and _same(token, read_token):
                raise DashboardWeakToken("the read token must differ from the write token")
        return cls(write=write, token=token if write else None, read_token=read_token,
                   secret=secret)

    def _set(self, token: str | None, read_token: str | None) -> None:
        self.token = token
        self.read_token = read_token
        if self._given_secret is not None:
            self.secret = self._given_secret
        elif token or read_token:
            # every process given the same tokens agrees on the sign-in form's CSRF token
            self.secret = hmac.new(f"{token or ''}\x00{read_token or ''}".encode(),
                                   b"pgjobs-dashboard", hashlib.sha256).digest()
        else:
            self.secret = secrets.token_bytes(32)

    @property
    def read_gate(self) -> bool:
        """Reading needs a token (a read token is set)."""
        return self.read_token is not None

    @property
    def sign_in(self) -> bool:
        """There is something to sign in for."""
        return self.write or self.read_gate

    def rotate(self, *, token: str | None = None, read_token: str | None = None) -> None:
        """New tokens (checked as at start; the read gate stays as it was): every session
        ends, signed in with the old ones or not."""
        new_token = token if token is not None else self.token
        new_read = read_token if read_token is not None else self.read_token
        checked = Guard.make(write=self.write, token=new_token, read_token=new_read)
        with self._lock:
            self._set(checked.token, checked.read_token)
            self._sessions.clear()

    # -- tokens -------------------------------------------------------------------------
    def level_of(self, given: str | None) -> str | None:
        """``write`` for the write token (in write mode), ``read`` for the read token, None
        for anything else. Both are compared, whatever matches, in constant time."""
        if given is None:
            return None
        write = self.write and self.token is not None and _same(self.token, given)
        read = self.read_token is not None and _same(self.read_token, given)
        return "write" if write else "read" if read else None

    @staticmethod
    def bearer(authorization: str | None) -> str | None:
        """The token of an ``Authorization: Bearer`` header (None: not a bearer header)."""
        scheme, _, value = (authorization or "").partition(" ")
        return value.strip() if scheme.lower() == "bearer" else None

    # -- sessions -----------------------------------------------------------------------
    def open_session(self, level: str) -> str:
        """A new session of ``level``; returns its cookie value."""
        value = secrets.token_urlsafe(32)
        now = self.clock()
        with self._lock:
            self._sessions[_digest(value)] = Session(level=level,
                                                     csrf=secrets.token_urlsafe(32),
                                                     opened=now, seen=now)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)  # the longest unused
        return value

    def session(self, value: str | None) -> Session | None:
        """The live session a cookie names (and mark it used), or None: no cookie, a
        malformed one, one this process never opened, one ended or expired."""
        if not value or not _SESSION_ID.match(value):
            return None
        key = _digest(value)
        now = self.clock()
        with self._lock:
            found = self._sessions.get(key)
            if found is None:
                return None
            if now - found.opened > SESSION_SECONDS or now - found.seen > IDLE_SECONDS:
                del self._sessions[key]
                return None
            found.seen = now
            self._sessions.move_to_end(key)
            return found

    def close_session(self, value: str | None) -> bool:
        """End the session a cookie names (sign-out): its id is forgotten."""
        if not value or not _SESSION_ID.match(value):
            return False
        with self._lock:
            return self._sessions.pop(_digest(value), None) is not None

    def sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    # -- CSRF ---------------------------------------------------------------------------
    @staticmethod
    def new_nonce() -> str:
        return secrets.token_urlsafe(24)

    @staticmethod
    def nonce_ok(nonce: str | None) -> bool:
        return bool(nonce) and _NONCE.match(nonce or "") is not None

    def login_csrf(self, nonce: str) -> str:
        """The sign-in form's CSRF token (no session yet): bound to the browser's nonce."""
        return hmac.new(self.secret, f"login:{nonce}".encode("ascii"),
                        hashlib.sha256).hexdigest()

    def login_csrf_ok(self, nonce: str | None, given: object) -> bool:
        if nonce is None or not self.nonce_ok(nonce):
            return False
        return _same(self.login_csrf(nonce), given)

    @staticmethod
    def csrf_ok(session: Session | None, given: object) -> bool:
        """A form of a signed-in browser: its session's own CSRF token, nothing else."""
        return session is not None and _same(session.csrf, given)
