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


The rule itself (:func:`refusal`, :func:`check_addresses`) lives in
:mod:`kombu_pgjobs.webhooks`, so that ``pgjobs webhooks add`` applies it without Celery.
"""

from __future__ import annotations

import ipaddress
import socket
import typing
from collections.abc import Callable
from typing import Any

import httpcore
import httpx

from kombu_pgjobs.errors import EgressRefused
from kombu_pgjobs.webhooks import METADATA_ADDRESSES, check_addresses, refusal

from .settings import WebhookSettings

__all__ = ["METADATA_ADDRESSES", "GuardedBackend", "check_addresses", "guarded_client",
           "refusal"]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[..., list[tuple[Any, ...]]]


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
            infos = self.resolve(host, port, type=socket.SOCK_STREAM)
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
                return self.inner.connect_tcp(str(address), port, timeout=timeout,
                                              local_address=local_address,
                                              socket_options=socket_options)
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
