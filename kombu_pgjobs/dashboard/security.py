"""Who may change things from the dashboard, and proof that a form came from its own page.

Read-only is the default: every action answers 403 before it reads its form. In write mode an
action needs the operator's token, either as ``Authorization: Bearer TOKEN`` (scripts: a header
a cross-site page cannot send, so no CSRF token is asked for) or as the signed session cookie
that signing in with the token sets (browsers: then the form must carry the CSRF token of its
page). Both cookies are HttpOnly and SameSite=Strict.

The CSRF token is an HMAC of a random per-browser nonce (its own cookie) under the app's
secret, so a page on a sibling domain that can plant cookies still cannot mint a valid pair.
The secret derives from the write token (every process started with the same token agrees,
and a new token voids every session) unless one is given.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

__all__ = ["CSRF_COOKIE", "SESSION_COOKIE", "SESSION_SECONDS", "Guard"]

CSRF_COOKIE = "pgjobs_csrf"
SESSION_COOKIE = "pgjobs_session"
#: how long a sign-in lasts
SESSION_SECONDS = 12 * 3600
#: the shortest write token accepted
MIN_TOKEN = 16


@dataclass(frozen=True)
class Guard:
    """The write switch, the token and the signing secret of one dashboard."""

    write: bool
    token: str | None
    secret: bytes

    @classmethod
    def make(cls, *, write: bool, token: str | None, secret: bytes | None = None) -> Guard:
        if secret is None:
            secret = (hmac.new(token.encode(), b"pgjobs-dashboard", hashlib.sha256).digest()
                      if token else secrets.token_bytes(32))
        return cls(write=write, token=token, secret=secret)

    def _sign(self, text: str) -> str:
        return hmac.new(self.secret, text.encode(), hashlib.sha256).hexdigest()

    # -- CSRF ---------------------------------------------------------------------------
    @staticmethod
    def new_nonce() -> str:
        return secrets.token_urlsafe(24)

    def csrf_token(self, nonce: str) -> str:
        return self._sign(f"csrf:{nonce}")

    def csrf_ok(self, nonce: str | None, token: str | None) -> bool:
        if not nonce or not token:
            return False
        return hmac.compare_digest(self.csrf_token(nonce), str(token))

    # -- the write token ----------------------------------------------------------------
    def token_ok(self, given: str | None) -> bool:
        if not self.token or given is None:
            return False
        return hmac.compare_digest(self.token.encode(), str(given).encode())

    def bearer_ok(self, authorization: str | None) -> bool:
        scheme, _, value = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and self.token_ok(value.strip())

    def session_value(self, now: float | None = None) -> str:
        issued = str(int(time.time() if now is None else now))
        return f"{issued}.{self._sign(f'session:{issued}')}"

    def session_ok(self, value: str | None, now: float | None = None) -> bool:
        if not self.write or not self.token or not value:
            return False
        issued, _, sig = value.partition(".")
        if not issued.isdigit() or not hmac.compare_digest(self._sign(f"session:{issued}"), sig):
            return False
        age = (time.time() if now is None else now) - int(issued)
        return 0 <= age <= SESSION_SECONDS
