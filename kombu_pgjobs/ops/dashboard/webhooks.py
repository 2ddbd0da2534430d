"""The webhook pages and actions: ``/webhooks`` (endpoints, keyset pages), ``/webhooks/<id>``
(an endpoint and its recent attempts from the ledger), and POST ``.../enable`` and
``.../disable``.

Everything goes through :class:`~kombu_pgjobs.store.webhooks.WebhookStore`, as ``pgjobs webhooks
ls|show|attempts|enable|disable`` do; the store never selects an endpoint's secret for these
reads, so no page can show it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ...store.admin import Admin
from ...store.webhooks import WEBHOOK_SCHEMA_VERSION, WebhookStore
from .actions import action
from .app import Dashboard
from .pages import PAGE, query_arg

__all__ = ["routes"]


def routes(dash: Dashboard) -> list[BaseRoute]:
    def store(admin: Admin) -> WebhookStore:
        dash.need(admin, WEBHOOK_SCHEMA_VERSION, "webhook pages")
        return WebhookStore(admin.conn, admin.schema)

    async def listing(request: Request) -> Response:
        after = query_arg(request, "after")
        page = await dash.run(lambda admin: store(admin).ls(after=after, limit=PAGE))
        return dash.render(request, "webhooks.html", {"page": page})

    async def endpoint(request: Request) -> Response:
        ident = request.path_params["id"]
        before = query_arg(request, "before")

        def read(admin: Admin) -> dict[str, Any]:
            s = store(admin)
            return {"e": s.show(ident), "attempts": s.attempts(ident, before=before,
                                                                limit=PAGE)}

        return dash.render(request, "webhook.html", await dash.run(read))

    def enable(enabled: bool) -> Any:
        def perform(admin: Admin, p: Mapping[str, str]) -> dict[str, Any]:
            return store(admin).set_enabled(p["id"], enabled)

        return perform

    def back(p: Mapping[str, str]) -> str:
        return f"/webhooks/{p['id']}"

    post = ["POST"]
    return [
        Route("/webhooks", listing, name="webhooks"),
        Route("/webhooks/{id}", endpoint, name="webhook"),
        Route("/webhooks/{id}/enable", action(
            dash, lambda p: f"Enable webhook endpoint {p['id']} (its failure count starts "
                            "again from 0)", enable(True), back), methods=post),
        Route("/webhooks/{id}/disable", action(
            dash, lambda p: f"Disable webhook endpoint {p['id']}: its deliveries are "
                            "dead-lettered unattempted until enabled", enable(False), back),
              methods=post),
    ]
