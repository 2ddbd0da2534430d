"""Egress safety: webhook deliveries connect only to public addresses, checked at connect time.

A webhook URL is typed by a customer; left alone, a worker inside a private network would POST
wherever it points: the cloud metadata service, an admin port on localhost, a database on
10.0.0.5. So every connection a delivery opens goes through :class:`GuardedBackend`, an
httpcore network backend that

1. resolves the host name itself (``getaddrinfo``, once),
2. checks every address it got: private, loopback, link-local, unspecified, multicast,
   reserved, shared (100.64/10) and cloud metadata addresses are refused unless the host name
   or a network holding the address is in ``pgjobs_webhook_allow_hosts``; one refused address
   refuses the host (a name that resolves to a public and a private address is a trap),
3. connects to the checked address itself (the IP literal, never the name again).

Because the connection goes to the very address that was checked, there is no second lookup an
attacker's DNS server could answer differently (the DNS-rebinding gap between "check the name"
and "connect to the name"). TLS still verifies the certificate against the URL's host name
(httpcore takes the SNI name from the URL, not from the address connected to). Redirects are
never followed, proxies from the environment are ignored (a proxy would connect for us,
unchecked), Unix sockets are refused, and a kept-alive connection was checked when it was made.


**One deadline per attempt.** httpx's timeouts bound each wait (a connect, one read, one
write), so a server that trickles its answer a byte at a time, each within the timeout, could
hold a worker for as long as it likes. Inside :func:`attempt_deadline` every step of the
attempt is bounded by what is left of one wall-clock budget: the name lookup (run aside and
abandoned at the deadline), the connect, the TLS handshake, every write and every read take at
most the time remaining, and at the deadline a watchdog shuts down every socket the attempt
used, which ends whatever step is blocked (a handshake or a send that a per-call timeout
cannot bound). An attempt therefore ends by its deadline whatever the server does.

The rule itself (:func:`refusal`, :func:`check_addresses`) lives in
:mod:`kombu_pgjobs.store.webhooks`, so that ``pgjobs webhooks add`` applies it without Celery.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpcore
import httpx

from kombu_pgjobs.errors import EgressRefused
from kombu_pgjobs.store.webhooks import METADATA_ADDRESSES, check_addresses, refusal

from .settings import WebhookSettings

__all__ = ["METADATA_ADDRESSES", "Attempt", "GuardedBackend", "attempt_deadline",
           "check_addresses", "guarded_client", "refusal"]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[..., list[tuple[Any, ...]]]


class Attempt:
    """One attempt's deadline, and the streams it used (shut down when it passes)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.expired = False
        self._streams: set[DeadlineStream] = set()
        self._lock = threading.Lock()

    def left(self, timeout: float | None, error: type[Exception]) -> float:
        """``timeout`` bounded by what is left of the budget; ``error`` when nothing is."""
        left = self.at - time.monotonic()
        if left <= 0 or self.expired:
            raise error(f"the attempt's deadline of {self.seconds:g} s passed")
        return left if timeout is None else min(timeout, left)

    def use(self, stream: DeadlineStream) -> None:
        with self._lock:
            if self.expired:
                stream.abort()
            else:
                self._streams.add(stream)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            streams = list(self._streams)
        for stream in streams:
            stream.abort()


_current = threading.local()


def current_attempt() -> Attempt | None:
    return getattr(_current, "attempt", None)


@contextmanager
def attempt_deadline(seconds: float) -> Iterator[Attempt]:
    """Every connection step of this thread's requests inside is bounded by ``seconds`` of
    wall-clock time in all (see the module's docstring)."""
    attempt = Attempt(seconds)
    previous = current_attempt()
    _current.attempt = attempt
    watchdog = threading.Timer(seconds, attempt.expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield attempt
    finally:
        watchdog.cancel()
        _current.attempt = previous


def _bounded(timeout: float | None, error: type[Exception]) -> float | None:
    attempt = current_attempt()
    return timeout if attempt is None else attempt.left(timeout, error)


class DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read, write and handshake is bounded by the current
    attempt's deadline, and which the attempt's watchdog can shut down."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self.inner = inner

    def _enter(self) -> None:
        attempt = current_attempt()
        if attempt is not None:
            attempt.use(self)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._enter()
        return self.inner.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._enter()
        # in slices, each bounded afresh: one call's timeout would apply to every partial send
        view = memoryview(buffer)
        while view:
            self.inner.write(bytes(view[:16384]), _bounded(timeout, httpcore.WriteTimeout))
            view = view[16384:]

    def close(self) -> None:
        self.inner.close()

    def abort(self) -> None:
        """Shut the socket down from another thread: a blocked step of its owner ends now."""
        sock = self.inner.get_extra_info("socket")
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        self._enter()
        return DeadlineStream(self.inner.start_tls(
            ssl_context, server_hostname, _bounded(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


def _resolve_within(resolve: Resolver, host: str, port: int) -> list[tuple[Any, ...]]:
    """``resolve(host, port)``, given at most what is left of the attempt: a lookup that
    hangs is left behind (on a daemon thread) rather than waited for."""
    attempt = current_attempt()
    if attempt is None:
        return resolve(host, port, type=socket.SOCK_STREAM)
    left = attempt.left(None, httpcore.ConnectTimeout)
    result: list[Any] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            result.append(resolve(host, port, type=socket.SOCK_STREAM))
        except BaseException as exc:  # handed to the waiting thread
            result.append(exc)
        finally:
            done.set()

    threading.Thread(target=lookup, daemon=True, name=f"resolve {host}").start()
    if not done.wait(left):
        raise httpcore.ConnectTimeout(f"resolving {host} took longer than the attempt's "
                                      f"deadline of {attempt.seconds:g} s")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]  # type: ignore[no-any-return]


class GuardedBackend(httpcore.NetworkBackend):
    """httpcore's sync backend with the resolve, check, connect-to-the-checked-address step."""

    def __init__(self, settings: WebhookSettings, *,
                 resolve: Resolver = socket.getaddrinfo) -> None:
        self.settings = settings
        self.resolve = resolve
        self.inner = httpcore.SyncBackend()

    def addresses(self, host: str, port: int) -> list[Address]:
        try:
            return [ipaddress.ip_address(host.strip("[]"))]
        except ValueError:
            pass
        try:
            infos = _resolve_within(self.resolve, host, port)
        except OSError as exc:  # an unknown name: a connection error (retried)
            raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from exc
        found: list[Address] = []
        for info in infos:
            address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
            if address not in found:
                found.append(address)
        if not found:
            raise httpcore.ConnectError(f"{host} resolves to no address")
        return found

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: typing.Iterable[Any] | None = None
                    ) -> httpcore.NetworkStream:
        found = self.addresses(host, port)
        check_addresses(host, found, allow_names=self.settings.allow_names,
                        allow_networks=self.settings.allow_networks)
        error: Exception | None = None
        for address in found:  # the checked addresses, never the name again
            try:
                return DeadlineStream(self.inner.connect_tcp(
                    str(address), port, timeout=_bounded(timeout, httpcore.ConnectTimeout),
                    local_address=local_address, socket_options=socket_options))
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        assert error is not None
        raise error

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: typing.Iterable[Any] | None = None
                            ) -> httpcore.NetworkStream:
        raise EgressRefused("webhooks do not connect to Unix sockets")

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


class _GuardedTransport(httpx.HTTPTransport):
    """httpx's transport over a pool whose connections go through :class:`GuardedBackend`."""

    def __init__(self, backend: GuardedBackend) -> None:
        super().__init__(trust_env=False)
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False), max_connections=20,
            max_keepalive_connections=10, keepalive_expiry=30.0, network_backend=backend)


def guarded_client(settings: WebhookSettings, *,
                   resolve: Resolver = socket.getaddrinfo) -> httpx.Client:
    """An httpx client for deliveries: egress-checked, no redirects, no proxies."""
    backend = GuardedBackend(settings, resolve=resolve)
    return httpx.Client(transport=_GuardedTransport(backend), follow_redirects=False,
                        trust_env=False, timeout=settings.timeout)
