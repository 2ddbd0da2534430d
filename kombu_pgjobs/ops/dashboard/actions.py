"""The actions (POST): pause, resume and purge a queue; requeue or cancel a message, one or the
ones selected in the list; requeue or purge dead letters, one, the ones selected, or by filter;
sign in and out.

Every action goes through the same gate, in this order, and changes nothing when refused:
the read gate, when the dashboard has a read token (401, ``PGJ-439``); read-only mode (403,
``PGJ-432``); the write token, as a bearer header or a session signed in with it (403,
``PGJ-433``; a wrong bearer token counts toward the client's backoff, ``PGJ-438``); with a
session, the form's CSRF token, which is that session's own (403, ``PGJ-434``). Then a form
without ``confirm=yes`` gets a confirmation page (a script sends ``confirm=yes`` itself; in a
browser the page's script asks ``confirm()`` and adds it), and only then does the action run,
through :class:`~kombu_pgjobs.store.admin.Admin` like the CLI's command of the same name.

A bulk action (requeue or purge every dead letter of a filter, purge a queue) never asks in the
page's dialog: its confirmation page reads the rows the filter selects now, at most one batch
(every filter the page applies, the task and tenant included), says how many, and carries their
ids; confirmed, the action acts on exactly those rows (by id: a row that changed meanwhile stops
it, nothing done), never on whatever matches by then. A script that sends ``confirm=yes`` with
the filter itself acts by the filter, as the CLI does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from psycopg import sql
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from ...errors import (
    DashboardCsrfFailed,
    DashboardReadOnly,
    DashboardUnauthorized,
    InvalidArgument,
)
from ...store import audit
from ...store.admin import DEFAULT_BULK_LIMIT, MAX_PAGE, Admin
from .app import (
    Dashboard,
    access,
    client_of,
    safe_next,
    set_cookie,
    throttled,
    wants_json,
)
from .security import CSRF_COOKIE, SESSION_COOKIE, SESSION_SECONDS

__all__ = ["action", "routes"]

log = logging.getLogger("kombu_pgjobs.dashboard.actions")

#: (what it does, in words) and (what it does, to the database)
Describe = Callable[[Mapping[str, str]], str]
Perform = Callable[[Admin, Mapping[str, str]], Any]
#: what a bulk action would touch now (read at its confirmation): see :class:`Preview`
Survey = Callable[[Admin, Mapping[str, str]], "Preview"]
#: what was done, in words, from the action's result: (headline, ids to link, a note)
Report = Callable[[Any, Mapping[str, str]], "Done"]
#: most rows one bulk action touches from the dashboard (one confirmation, one batch)
BULK_BATCH = min(DEFAULT_BULK_LIMIT, MAX_PAGE)


@dataclass(frozen=True)
class Preview:
    """The rows a bulk action would touch now: ``count`` of them, ``more`` when the filter
    matches more than one batch, and the hidden ``fields`` the confirmation posts back (the
    ids, or the bound) so that the action touches those rows and no others."""

    count: int
    more: bool
    fields: dict[str, str]


@dataclass(frozen=True)
class Done:
    """A result in words for the result page: the headline, the ids it names (linked), and a
    note (what remains)."""

    headline: str
    ids: list[int] = field(default_factory=list)
    link: str = "/messages/"
    note: str | None = None


def _opt(params: Mapping[str, str], name: str) -> str | None:
    value = str(params.get(name) or "").strip()
    return value or None


def _limit(params: Mapping[str, str]) -> int:
    raw = _opt(params, "limit")
    if raw is None:
        return DEFAULT_BULK_LIMIT
    if not raw.isdigit():
        raise InvalidArgument(f"limit {raw!r} is not a whole number")
    return int(raw)


def _refuse_unknown(params: Mapping[str, str], keys: tuple[str, ...]) -> dict[str, Any]:
    """A bulk action given a filter it cannot apply is refused, never run on more rows than
    the filter names (a purge by task would have deleted every dead letter of the queue)."""
    given = [k for k in keys if _opt(params, k)]
    if given:
        raise InvalidArgument(
            f"this action cannot be limited by {', '.join(given)}: nothing was done; act on "
            "the rows one by one, or with the CLI's filters")
    return {}


def _bulk(what: str, params: Mapping[str, str], keys: tuple[str, ...]) -> str:
    """A bulk action in words: what, the filters given, and its bound."""
    given = "".join(f", {k} {params[k]}" for k in keys if _opt(params, k))
    ids = _id_list(params)
    if ids is not None:
        return f"{what}{given}: the {_n(len(ids), 'dead letter')} listed"
    return f"{what}{given} (at most {_limit(params)})"


def _id_list(params: Mapping[str, str]) -> list[str] | None:
    """The ids a confirmation carries (comma-separated, at most one batch); None when the
    form has no ``ids`` (a script acting by the filter)."""
    if "ids" not in params:
        return None
    ids = [i.strip() for i in str(params["ids"]).split(",") if i.strip()]
    if len(ids) > BULK_BATCH:
        raise InvalidArgument(f"at most {BULK_BATCH} ids at once, got {len(ids)}")
    bad = [i for i in ids if not i.isdigit()]
    if bad:
        raise InvalidArgument(f"id {bad[0][:40]!r} is not a number")
    return ids


def _batch(params: Mapping[str, str]) -> int:
    """The bound of a bulk action's confirmation: the form's ``limit``, at most one batch."""
    limit = _limit(params)
    if not 1 <= limit <= BULK_BATCH:
        raise InvalidArgument(f"limit must be between 1 and {BULK_BATCH} here, got {limit} "
                              "(the CLI takes more at once)")
    return limit


def _survey_dead(admin: Admin, p: Mapping[str, str]) -> Preview:
    """The dead letters the page's filter lists now, one batch of them, by id."""
    limit = _batch(p)
    ids: list[int] = []
    after: str | None = None
    more = False
    while len(ids) < limit:  # the tenant filter may make a page shorter than asked
        page = admin.dead_ls(queue=_opt(p, "queue"), task=_opt(p, "task"),
                             reason=_opt(p, "reason"), tenant=_opt(p, "tenant"),
                             after=after, limit=min(MAX_PAGE, limit - len(ids)))
        ids += [int(r["id"]) for r in page["items"]]
        after = page["next"]
        if after is None:
            break
    else:
        more = after is not None
    return Preview(count=len(ids), more=more, fields={"ids": ",".join(map(str, ids))})


def _survey_purge(admin: Admin, p: Mapping[str, str]) -> Preview:
    """A dead-letter purge's confirmation: refused at once for a filter it cannot apply (the
    task, the tenant) or one the page does not list by (an age: the CLI purges by age)."""
    _refuse_unknown(p, ("task", "tenant", "older_than"))
    if not _opt(p, "queue"):
        raise InvalidArgument("purge all needs a queue: nothing was done")
    return _survey_dead(admin, p)


#: what a dead-letter requeue by filter cannot apply (the purge's age)
_REQUEUE_CANNOT = ("older_than",)
#: what a queue purge cannot apply: it deletes every ready, delayed and waiting message of
#: the queue, whatever its task, tenant or state
_PURGE_QUEUE_CANNOT = ("task", "tenant", "reason", "state", "older_than")


def _survey_requeue(admin: Admin, p: Mapping[str, str]) -> Preview:
    """A dead-letter requeue's confirmation: refused at once for a filter it cannot apply."""
    _refuse_unknown(p, _REQUEUE_CANNOT)
    return _survey_dead(admin, p)


def _survey_queue(admin: Admin, p: Mapping[str, str]) -> Preview:
    """A queue's messages a purge deletes (ready, delayed, waiting), one batch: the purge
    is then bounded by their number (it deletes in id order, as they were counted). A
    filter it cannot apply (a task, a tenant...) is refused."""
    _refuse_unknown(p, _PURGE_QUEUE_CANNOT)
    limit = _batch(p)
    page = admin.ls(states=["ready", "delayed", "waiting"], queue=p["name"], limit=limit)
    count = len(page["items"])
    return Preview(count=count, more=page["next"] is not None, fields={"limit": str(count)})


def _dead_requeue(admin: Admin, p: Mapping[str, str]) -> Any:
    _refuse_unknown(p, _REQUEUE_CANNOT)
    ids = _id_list(p)
    if ids is not None:  # the rows confirmed, and no others
        return admin.dead_requeue(ids) if ids else {"requeued": [], "skipped": [],
                                                     "remaining": 0}
    return admin.dead_requeue(queue=_opt(p, "queue"), task=_opt(p, "task"),
                              tenant=_opt(p, "tenant"), reason=_opt(p, "reason"),
                              limit=_limit(p))


def _purge_queue(admin: Admin, p: Mapping[str, str]) -> Any:
    _refuse_unknown(p, _PURGE_QUEUE_CANNOT)
    return admin.purge(p["name"], limit=_limit(p))


def _dead_purge(admin: Admin, p: Mapping[str, str]) -> Any:
    refused = _refuse_unknown(p, ("task", "tenant"))
    ids = _id_list(p)
    if ids is not None:  # the rows confirmed, and no others
        return admin.dead_purge(ids) if ids else {"matched": 0, "purged": 0, "remaining": 0}
    return admin.dead_purge(queue=_opt(p, "queue"), reason=_opt(p, "reason"),
                            older_than=_opt(p, "older_than"), limit=_limit(p), **refused)


def _selected(params: Mapping[str, str]) -> list[str]:
    """The ids a list's checkboxes selected (``pick``, carried as ``ids`` by the
    confirmation): at least one, at most one batch."""
    ids = _id_list(params) or []
    if not ids:
        raise InvalidArgument("nothing was selected: tick the rows to act on; nothing was done")
    return ids


def _survey_selected(table: str) -> Survey:
    """A selection's confirmation: how many of the selected ids are still there (in
    ``table``: ``job`` for messages, ``dead`` for dead letters), and those ids, no others."""

    def survey(admin: Admin, p: Mapping[str, str]) -> Preview:
        ids = [int(i) for i in _selected(p)]
        name = "pgjobs_dead_letter" if table == "dead" else "pgjobs_job"
        rows = admin.conn.execute(
            sql.SQL("SELECT id FROM {}.{} WHERE id = ANY(%s::bigint[]) ORDER BY id").format(
                sql.Identifier(admin.schema), sql.Identifier(name)), [ids]).fetchall()
        there = [int(r[0]) for r in rows]
        return Preview(count=len(there), more=False,
                       fields={"ids": ",".join(map(str, there))})

    return survey


def _selected_words(what: str, one: str) -> Describe:
    def describe(p: Mapping[str, str]) -> str:
        ids = _id_list(p) or []
        return f"{what} the {_n(len(ids), one)} selected ({', '.join(ids[:20])}" + \
            (", ...)" if len(ids) > 20 else ")")

    return describe


def _n(count: int, one: str, many: str | None = None) -> str:
    return f"{count:,} {one if count == 1 else (many or one + 's')}"


def _requeued(result: Any, p: Mapping[str, str]) -> Done:
    moved = [int(r["id"]) for r in result.get("requeued", [])]
    made_due = [int(i) for i in result.get("made_due", [])]
    skipped = result.get("skipped") or []
    parts = []
    if moved or not made_due:
        parts.append(f"Requeued {_n(len(moved), 'dead letter')} (back to ready, attempts "
                     "from 0)")
    if made_due:
        parts.append(f"made {_n(len(made_due), 'delayed message')} due now")
    unchanged = result.get("unchanged") or []
    if unchanged:
        parts.append(f"{_n(len(unchanged), 'message')} already ready or waiting, left as "
                     "they were")
    note = None
    if skipped:
        note = (f"{_n(len(skipped), 'dead letter')} stayed dead: a live message holds "
                f"its idempotency key ({', '.join(map(str, skipped))})")
    elif result.get("remaining"):
        note = f"{_n(int(result['remaining']), 'dead letter')} of this filter remain"
    return Done("; ".join(parts), moved + made_due, "/messages/", note)


def _purged_dead(result: Any, p: Mapping[str, str]) -> Done:
    note = (f"{_n(int(result['remaining']), 'dead letter')} of this filter remain"
            if result.get("remaining") else None)
    return Done(f"Deleted {_n(int(result.get('purged', 0)), 'dead letter')} for good",
                note=note)


def _purged_queue(result: Any, p: Mapping[str, str]) -> Done:
    note = (f"{_n(int(result['remaining']), 'message')} remain queued, "
            f"{_n(int(result.get('running', 0)), 'running message')} finish")
    return Done(f"Deleted {_n(int(result['purged']), 'message')} of queue {result['queue']}",
                note=note)


def _paused(result: Any, p: Mapping[str, str]) -> Done:
    if result["paused"]:
        return Done(f"Queue {result['queue']} is paused: claims skip it, running messages "
                    "finish")
    return Done(f"Queue {result['queue']} is resumed")


def _cancelled(result: Any, p: Mapping[str, str]) -> Done:
    cancelled = [int(i) for i in result.get("cancelled", [])]
    marked = [int(i) for i in result.get("marked", [])]
    parts = []
    if cancelled:
        parts.append(f"Cancelled {_n(len(cancelled), 'queued message')} (kept as dead "
                     "letters, reason cancelled)")
    if marked:
        parts.append(f"marked {_n(len(marked), 'running message')} cancelled: its worker "
                     "ends the run")
    return Done("; ".join(parts) or "Nothing to cancel", cancelled + marked, "/messages/")


def _purged_one(result: Any, p: Mapping[str, str]) -> Done:
    return Done(f"Deleted dead letter {p['id']} for good" if result.get("purged")
                else f"Dead letter {p['id']} was already gone")


async def _gate(dash: Dashboard, request: Request) -> tuple[FormData, str]:
    """Refuse what may not run (see the module's docstring); the form of what may, and how
    the write token was shown (``bearer`` or ``session``: the audit log's actor)."""
    if not dash.guard.write:
        raise DashboardReadOnly()
    level, session = access(dash, request)
    if session is None and level is not None:  # a bearer token: a header no page can send
        if level != "write":
            raise DashboardUnauthorized("the bearer token is the read token: actions need the "
                                        "write token; nothing was changed")
        return await request.form(), "bearer"
    if session is None or level != "write":
        raise DashboardUnauthorized()
    form = await request.form()
    if not dash.guard.csrf_ok(session, _field(form, "csrf")):
        raise DashboardCsrfFailed()
    return form, "session"


#: the first part of an action's path -> the audit log's word for it (as the CLI's command)
_AUDIT_NOUNS = {"queues": "", "messages": "", "dead": "dead ", "schedules": "schedule ",
                "webhooks": "webhooks "}


def audit_name(request: Request) -> str:
    """An action's name in the audit log, the CLI's command of the same effect: ``pause``,
    ``dead requeue``, ``schedule resume``, ``webhooks disable``..."""
    route = request.scope.get("route")
    path = str(getattr(route, "path", request.url.path))
    parts = [p for p in path.split("/") if p]
    return f"{_AUDIT_NOUNS.get(parts[0], parts[0] + ' ')}{parts[-1]}"


def _field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


def action(dash: Dashboard, describe: Describe, perform: Perform,
           back: Callable[[Mapping[str, str]], str], *, survey: Survey | None = None,
           report: Report | None = None) -> Callable[[Request], Any]:
    """The handler of one action: the gate, the confirmation, then ``perform`` (its result
    as JSON for a script, as a page for a browser, with a link ``back``). A bulk action's
    ``survey`` reads what it would touch for the confirmation (see the module's docstring);
    ``report`` says what was done, in words, on the result page."""

    async def handler(request: Request) -> Response:
        form, actor = await _gate(dash, request)
        fields = {k: v for k, v in form.items()
                  if isinstance(v, str) and k not in ("csrf", "confirm", "pick")}
        picked = [v for v in form.getlist("pick") if isinstance(v, str)]
        if picked:  # a list's checkboxes: the exact ids selected
            fields["ids"] = ",".join(dict.fromkeys(v.strip() for v in picked))
        params = {**fields, **{k: str(v) for k, v in request.path_params.items()}}
        if _field(form, "confirm") != "yes":
            preview = None
            if survey is not None:
                checked = params
                preview = await dash.run(lambda admin: survey(admin, checked))
                fields = {**fields, **preview.fields}
                params = {**params, **preview.fields}
            what = describe(params)
            if wants_json(request):
                return JSONResponse({"confirm": what, "fields": fields, **(
                    {"count": preview.count, "more": preview.more} if preview else {})})
            return dash.render(request, "confirm.html", {
                "what": what, "action": request.url.path, "fields": fields,
                "preview": preview, "batch": BULK_BATCH, "back": back(params)})
        what = describe(params)
        name, client = audit_name(request), client_of(request)

        def audited(admin: Admin) -> Any:
            """The action and its audit row in one transaction (issue 34)."""
            with admin.conn.transaction():
                done = perform(admin, params)
                if dash.has(admin, audit.AUDIT_VERSION):
                    audit.record(admin.conn, admin.schema, origin="dashboard", actor=actor,
                                 host=client, action=name, target=params,
                                 rows=audit.rows_of(done))
            return done

        result = await dash.run(audited)
        log.info("pgjobs.dashboard.action %s", what,
                 extra={"action": "dashboard", "path": request.url.path})
        if wants_json(request):
            return JSONResponse(result)
        done = report(result, params) if report is not None else Done(what)
        return dash.render(request, "result.html",
                           {"what": what, "done": done, "result": result,
                            "back": back(params)})

    return handler


def routes(dash: Dashboard) -> list[BaseRoute]:
    def act(describe: Describe, perform: Perform, back: Callable[[Mapping[str, str]], str],
            **more: Any) -> Callable[[Request], Any]:
        return action(dash, describe, perform, back, **more)

    def to_overview(p: Mapping[str, str]) -> str:
        return "/"

    def to_message(p: Mapping[str, str]) -> str:
        return f"/messages/{p['id']}"

    def to_messages(p: Mapping[str, str]) -> str:
        return "/messages"

    def to_dead(p: Mapping[str, str]) -> str:
        """Back to the dead letters page with the filter it had."""
        query = {k: p[k] for k in ("queue", "task", "reason", "tenant") if _opt(p, k)}
        return "/dead" + (f"?{urlencode(query)}" if query else "")

    async def login(request: Request) -> Response:
        """Sign in with the write or the read token: a new session (any older one of this
        browser ends: a sign-in never keeps an id someone else may have planted)."""
        guard = dash.guard
        if not guard.sign_in:
            raise DashboardReadOnly("this dashboard is read-only and open to read: there is "
                                    "nothing to sign in for")
        client = client_of(request)
        throttled(guard, client)
        form = await request.form()
        cookie = request.cookies.get(SESSION_COOKIE)
        session = guard.session(cookie)
        given = _field(form, "csrf")
        if not (guard.csrf_ok(session, given) if session is not None
                else guard.login_csrf_ok(request.cookies.get(CSRF_COOKIE), given)):
            raise DashboardCsrfFailed()
        level = guard.level_of(_field(form, "token"))
        if level is None:
            wait = guard.throttle.fail(client)
            log.warning("pgjobs.dashboard.login_refused from %s", client,
                        extra={"action": "dashboard", "client": client, "wait": wait})
            raise DashboardUnauthorized("the token is wrong: you are not signed in")
        guard.throttle.succeed(client)
        guard.close_session(cookie)
        response = RedirectResponse(
            dash.url(request, safe_next(_field(form, "next") or request.query_params.get(
                "next"))), status_code=303)
        set_cookie(dash, request, response, SESSION_COOKIE, guard.open_session(level),
                   max_age=SESSION_SECONDS)
        log.info("pgjobs.dashboard.signed_in %s from %s", level, client,
                 extra={"action": "dashboard", "client": client, "level": level})
        return response

    async def logout(request: Request) -> Response:
        """Sign out: the session ends here, on the server (a copy of its cookie opens
        nothing afterwards)."""
        guard = dash.guard
        cookie = request.cookies.get(SESSION_COOKIE)
        session = guard.session(cookie)
        response = RedirectResponse(dash.url(request, "/"), status_code=303)
        if session is not None:
            form = await request.form()
            if not guard.csrf_ok(session, _field(form, "csrf")):
                raise DashboardCsrfFailed()
            guard.close_session(cookie)
        if cookie is not None:
            set_cookie(dash, request, response, SESSION_COOKIE, "", max_age=0)
        return response

    post = ["POST"]
    return [
        Route("/login", login, methods=post),
        Route("/logout", logout, methods=post),
        # the lists' checkboxes: the exact ids selected (before /dead/{id}/...)
        Route("/dead/selected/requeue", act(
            _selected_words("Requeue", "dead letter"),
            lambda a, p: a.dead_requeue(_selected(p)), to_dead,
            survey=_survey_selected("dead"), report=_requeued), methods=post),
        Route("/dead/selected/purge", act(
            _selected_words("Purge (delete for good)", "dead letter"),
            lambda a, p: a.dead_purge(_selected(p)), to_dead,
            survey=_survey_selected("dead"), report=_purged_dead), methods=post),
        Route("/messages/selected/requeue", act(
            _selected_words("Requeue (run now)", "message"),
            lambda a, p: a.requeue(_selected(p)), to_messages,
            survey=_survey_selected("job"), report=_requeued), methods=post),
        Route("/messages/selected/cancel", act(
            _selected_words("Cancel", "message"),
            lambda a, p: a.cancel(_selected(p)), to_messages,
            survey=_survey_selected("job"), report=_cancelled), methods=post),
        Route("/queues/{name:path}/pause", act(
            lambda p: f"Pause queue {p['name']}: claims skip it, running messages finish",
            lambda a, p: a.pause(p["name"]), to_overview, report=_paused), methods=post),
        Route("/queues/{name:path}/resume", act(
            lambda p: f"Resume queue {p['name']}",
            lambda a, p: a.pause(p["name"], paused=False), to_overview, report=_paused),
              methods=post),
        Route("/queues/{name:path}/purge", act(
            lambda p: f"Purge queue {p['name']}: delete up to {_limit(p)} ready, delayed and "
                      "waiting messages (running ones finish)",
            _purge_queue, to_overview,
            survey=_survey_queue, report=_purged_queue), methods=post),
        Route("/messages/{id}/requeue", act(
            lambda p: f"Requeue message {p['id']}: run it now",
            lambda a, p: a.requeue([p["id"]]), to_message, report=_requeued), methods=post),
        Route("/messages/{id}/cancel", act(
            lambda p: f"Cancel message {p['id']}: a queued one becomes a dead letter "
                      "(reason cancelled); a running one is stopped by its worker (with "
                      "celery_ext), then becomes one",
            lambda a, p: a.cancel([p["id"]]), to_message, report=_cancelled), methods=post),
        Route("/dead/requeue", act(
            lambda p: _bulk("Requeue dead letters", p, ("queue", "task", "tenant", "reason")),
            _dead_requeue, to_dead, survey=_survey_requeue, report=_requeued), methods=post),
        Route("/dead/purge", act(
            lambda p: _bulk("Purge dead letters", p, ("queue", "reason", "older_than")),
            _dead_purge, to_dead, survey=_survey_purge, report=_purged_dead), methods=post),
        Route("/dead/{id}/requeue", act(
            lambda p: f"Requeue dead letter {p['id']}: back to ready, attempts from 0",
            lambda a, p: a.dead_requeue([p["id"]]), to_dead, report=_requeued),
              methods=post),
        Route("/dead/{id}/purge", act(
            lambda p: f"Purge dead letter {p['id']}: delete it for good",
            lambda a, p: a.dead_purge([p["id"]]), to_dead, report=_purged_one),
              methods=post),
    ]
