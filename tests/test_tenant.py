"""Tenant context (issue 12, items 1-3): declared on the task, stamped at publish, installed for
the body and cleared after it.

Declaration and publish refusals run in this process against a real schema (row counts read
back); what bodies see runs in real ``celery worker`` processes (tests/apps/tenanted.py), every
body and signal recording ``current_tenant()`` in Postgres.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery, chain, group

import celery_ext
import kombu_pgjobs
from celery_ext.limits import TENANT_HEADER, check_app_limits
from kombu_pgjobs.errors import (
    InvalidTaskOption,
    InvalidTenant,
    InvalidTenantOption,
    TenantRequired,
)
from kombu_pgjobs.limits import LIMITS_HEADER

from .conftest import import_app, wait_for

APP = "tests.apps.tenanted"


# ---------------------------------------------------------------- helpers

@pytest.fixture(autouse=True)
def _no_shared_tasks_left() -> Any:
    """Tasks declared here (and in the docs' code) are Celery "shared" tasks, which every app
    finalized later would get: forget them after each test, so other tests' apps stay clean."""
    from celery import _state

    saved = set(_state._on_app_finalizers)
    yield
    _state._on_app_finalizers.intersection_update(saved)


@pytest.fixture
def tenant_table(db: psycopg.Connection[Any], schema: str) -> str:
    db.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    db.execute(f'CREATE TABLE "{schema}".pgjobs_test_tenant (id bigserial PRIMARY KEY, '
               "label text, task text, arg text, seen text, phase text, pid int)")
    return schema


def _test_app(schema: str, url: str) -> Any:
    """tests/apps/tenanted.py imported for this test's schema (to publish from here)."""
    return import_app(APP, schema, url)


def _app(schema: str, url: str, **conf: Any) -> Celery:
    app = Celery(f"t{uuid.uuid4().hex[:6]}", broker=url)
    celery_ext.install(app)
    app.conf.update(broker_transport_options={"schema": schema}, task_ignore_result=True,
                    **conf)
    return app


def _rows(db: psycopg.Connection[Any], schema: str, phase: str = "body",
          like: str = "%") -> list[tuple[str, str, str | None, str | None]]:
    return db.execute(
        f'SELECT label, task, arg, seen FROM "{schema}".pgjobs_test_tenant '
        "WHERE phase = %s AND label LIKE %s ORDER BY id", (phase, like)).fetchall()


def _count(db: psycopg.Connection[Any], schema: str, like: str = "%") -> int:
    return db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_test_tenant '
                      "WHERE phase = 'body' AND label LIKE %s", (like,)).fetchone()[0]


def _jobs(db: psycopg.Connection[Any], schema: str) -> list[tuple[str, str | None, Any]]:
    """(task, tenant header, limits header) of every queued row, oldest first."""
    return db.execute(
        f"SELECT task, message->'headers'->>'{TENANT_HEADER}', "
        f"message->'headers'->'{LIMITS_HEADER}' FROM \"{schema}\".pgjobs_job ORDER BY id"
    ).fetchall()


# ---------------------------------------------------------------- declaration (no database)

def test_required_tenant_is_refused_at_the_decorator(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery import _state

    # Only Celery's own tasks: shared tasks that other test modules' apps declared (without
    # tenant=) would be offered to this app at finalize, and rightly refused.
    monkeypatch.setattr(_state, "_on_app_finalizers", {
        f for f in _state._on_app_finalizers if f.__module__ == "celery.app.builtins"})
    app = Celery("required")
    celery_ext.install(app)
    app.conf.pgjobs_tenant_required = True
    with pytest.raises(TenantRequired) as info:
        @app.task
        def bare() -> None: ...
    assert info.value.code == "PGJ-501" and "bare" in str(info.value)
    with pytest.raises(TenantRequired):
        @app.task(name="named", bind=True)
        def named(self: Any) -> None: ...
    assert isinstance(info.value, InvalidTaskOption)  # callers catching PGJ-407 still do

    @app.task(tenant="none")
    def nobody() -> None: ...

    @app.task(tenant=lambda org: org)
    def somebody(org: str) -> None: ...

    app.finalize()  # Celery's own tasks (celery.*) act for no tenant and are let through
    assert {"celery.chain", "celery.group"} <= set(app.tasks)
    assert "bare" not in {t.split(".")[-1] for t in app.tasks}


def test_required_tenant_from_a_configuration_loaded_later_is_checked_at_bind() -> None:
    app = Celery("late")
    celery_ext.install(app)

    @app.task(name="late.undeclared")
    def undeclared() -> None: ...

    class Config:
        pgjobs_tenant_required = True

    app.config_from_object(Config)
    with pytest.raises(TenantRequired):
        app.finalize()
        _ = app.tasks["late.undeclared"].name


@pytest.mark.parametrize("value", [None, "acme", "", "None", 3, ("org",)])
def test_bad_tenant_option_is_refused_at_the_decorator(value: Any) -> None:
    app = Celery("bad")
    celery_ext.install(app)
    with pytest.raises(InvalidTenantOption) as info:
        @app.task(tenant=value)
        def task() -> None: ...
    assert info.value.code == "PGJ-502" and "test_tenant.task" in str(info.value)


def test_bad_required_setting_is_refused() -> None:
    early = Celery("early")
    early.conf.pgjobs_tenant_required = 1
    with pytest.raises(InvalidTenantOption):
        celery_ext.install(early)
    app = Celery("badsetting")
    celery_ext.install(app)
    app.conf.pgjobs_tenant_required = "yes"
    with pytest.raises(InvalidTenantOption):
        @app.task(tenant="none")
        def task() -> None: ...


def test_current_tenant_outside_and_in_a_direct_call() -> None:
    app = Celery("direct")
    celery_ext.install(app)

    @app.task(tenant=lambda *a, **kw: kw["org"])
    def mine(*, org: str) -> str | None:
        return celery_ext.current_tenant()

    @app.task(tenant="none")
    def nobody() -> str | None:
        return celery_ext.current_tenant()

    @app.task(tenant=lambda *a, **kw: kw["org"])
    def outer(*, org: str) -> tuple[str | None, ...]:
        inner = (nobody(), mine(org="inner"))  # direct calls install their own tenant
        return (celery_ext.current_tenant(), *inner, celery_ext.current_tenant())

    assert celery_ext.current_tenant() is None
    assert outer(org="acme") == ("acme", None, "inner", "acme")
    assert celery_ext.current_tenant() is None
    with pytest.raises(InvalidTenant):  # the function's KeyError, coded
        mine()
    assert celery_ext.current_tenant() is None


# ---------------------------------------------------------------- publish (real schema)

def _raises(*a: Any, **kw: Any) -> str:
    raise LookupError("no org")


@pytest.mark.parametrize("fn", [_raises, lambda org: 42, lambda org: "", lambda org: None,
                                lambda org: "x" * 201, lambda org: "a\nb",
                                lambda org: "nul\x00"],
                         ids=["raises", "int", "empty", "None", "201 chars", "newline", "NUL"])
def test_bad_tenant_at_publish_writes_nothing(db, schema, url, fn) -> None:
    app = _app(schema, url)

    @app.task(name="bad", tenant=fn)
    def bad(org: str) -> None: ...

    @app.task(name="good", tenant=lambda org: org)
    def good(org: str) -> None: ...

    good.delay("first")  # migrates the schema; the count below could move
    with pytest.raises(InvalidTenant) as info:
        bad.delay("acme")
    assert info.value.code == "PGJ-503"
    with pytest.raises(InvalidTenant), kombu_pgjobs.batch():
        good.delay("in-batch")
        bad.delay("acme")
    assert [row[:2] for row in _jobs(db, schema)] == [("good", "first")]


def test_publish_stamps_the_declared_tenant_and_tenant_caps_use_it(db, schema, url) -> None:
    app = _app(schema, url, pgjobs_tenant_limit=2, pgjobs_tenant_rate=(10, 60))

    @app.task(name="mine", tenant=lambda *a, **kw: kw["org"])
    def mine(*, org: str) -> None: ...

    @app.task(name="nobody", tenant="none")
    def nobody() -> None: ...

    @app.task(name="plain")
    def plain() -> None: ...

    mine.delay(org="t1")
    mine.apply_async(kwargs={"org": "t2"}, headers={TENANT_HEADER: "forged"})  # declaration wins
    nobody.delay()
    nobody.apply_async(headers={TENANT_HEADER: "t3"})  # attribution by hand: kept for the caps
    plain.delay()
    jobs = _jobs(db, schema)
    assert [(task, tenant) for task, tenant, _ in jobs] == [
        ("mine", "t1"), ("mine", "t2"), ("nobody", None), ("nobody", "t3"), ("plain", None)]
    caps = [{c["key"] for c in (limits or {}).get("concurrency", [])} for *_, limits in jobs]
    rates = [{r["key"] for r in (limits or {}).get("rate", [])} for *_, limits in jobs]
    assert caps == [{"tenant:t1"}, {"tenant:t2"}, set(), {"tenant:t3"}, set()]
    assert rates == caps


# ---------------------------------------------------------------- real workers

TENANTS = [f"org-{n}" for n in range(10)]


@pytest.mark.e2e
@pytest.mark.parametrize("pool,concurrency", [("prefork", 2), ("threads", 4), ("gevent", 20)])
def test_a_thousand_bodies_see_their_own_tenant(db, tenant_table, url, start_worker,
                                                pool, concurrency) -> None:
    schema = tenant_table
    mod = _test_app(schema, url)
    with kombu_pgjobs.batch():
        for i in range(1000):
            org = TENANTS[(i // 10) % 10]
            if i % 10 == 9:  # "none": half of them with a tenant header set by hand
                headers = {TENANT_HEADER: org} if i % 20 == 19 else None
                mod.record_none.apply_async((f"n{i}", org), headers=headers)
            else:
                mod.record.delay(f"r{i}", org=org)
    started = time.monotonic()
    start_worker(app=APP, pool=pool, concurrency=concurrency,
                 env={"PGJOBS_TEST_PREFETCH": "8"})
    wait_for(lambda: _count(db, schema) >= 1000, 60, interval=0.3, what="1000 bodies")
    rows = _rows(db, schema)
    assert len(rows) == 1000 and len({label for label, *_ in rows}) == 1000
    declared = [(arg, seen) for _, task, arg, seen in rows if task == "record"]
    assert len(declared) == 900 and all(arg == seen for arg, seen in declared)
    assert {seen for _, seen in declared} == set(TENANTS)
    assert [seen for _, task, _, seen in rows if task == "record_none"] == [None] * 100
    assert time.monotonic() - started < 40, "1000 tasks took too long"


@pytest.mark.e2e
def test_nested_chain_and_group_members_carry_their_own_tenant(db, tenant_table, url,
                                                               start_worker) -> None:
    schema = tenant_table
    mod = _test_app(schema, url)
    mod.nested.delay("nest", org="parent", child_org="child")
    chain(mod.record.si("chain-1", org="c1"), mod.undeclared.si("chain-2"),
          mod.record.si("chain-3", org="c3"), mod.record_none.si("chain-4", "c4")).apply_async()
    group(mod.record.si(f"group-{n}", org=f"g{n}") for n in range(4)).apply_async()
    start_worker(app=APP, pool="threads", concurrency=2)
    wait_for(lambda: _count(db, schema) >= 12, 30, what="nested, chain and group bodies")
    time.sleep(0.5)  # anything extra would show up now
    seen = {label: (task, seen) for label, task, _, seen in _rows(db, schema)}
    assert seen == {
        "nest": ("nested", "parent"),
        "nest/record": ("record", "child"),       # its own declaration, not the caller's
        "nest/undeclared": ("undeclared", None),  # no declaration: nothing inherited
        "nest/none": ("record_none", None),
        "chain-1": ("record", "c1"), "chain-2": ("undeclared", None),
        "chain-3": ("record", "c3"), "chain-4": ("record_none", None),
        **{f"group-{n}": ("record", f"g{n}") for n in range(4)},
    }
    # at the message level too: the caller's header is not copied onto its children
    assert sorted((task, tenant) for task, tenant, _ in _jobs(db, schema)) == [
        ("record", "child"), ("undeclared", None)]


@pytest.mark.e2e
def test_no_tenant_is_left_behind_on_the_same_child(db, tenant_table, url,
                                                    start_worker) -> None:
    """Fail, retry, reject, revoke and a forged header, each followed by a probe, on one
    prefork child: the signals around every body (and the probe's body) see no tenant."""
    schema = tenant_table
    mod = _test_app(schema, url)
    worker = start_worker(app=APP, pool="prefork", concurrency=1)

    def then_probe(n: int, body_rows: int, like: str) -> None:
        wait_for(lambda: _count(db, schema, like) >= body_rows, 30, what=like)
        mod.undeclared.delay(f"leak-probe-{n}")
        wait_for(lambda: _count(db, schema, f"leak-probe-{n}") >= 1, 30, what=f"probe {n}")

    mod.fails.delay("leak-fail", org="a")
    then_probe(1, 1, "leak-fail")
    mod.retries.delay("leak-retry", org="b")
    then_probe(2, 2, "leak-retry")  # the first attempt retries, the second ends
    mod.rejects.delay("leak-reject", org="c")
    then_probe(3, 1, "leak-reject")
    revoked = str(uuid.uuid4())
    replies = mod.app.control.revoke(revoked, reply=True, timeout=10)
    assert replies, "the worker answered the revoke"
    mod.record.apply_async(("leak-revoked",), {"org": "d"}, task_id=revoked)
    # a header naming another tenant than the arguments give: the body must not run
    mod.app.send_task("record", ("leak-forged",), {"org": "e"},
                      headers={TENANT_HEADER: "someone-else"})
    then_probe(4, 0, "leak-revoked")
    wait_for(lambda: "PGJ-504" in worker.output(), 30, what="the forged message refused")
    mod.fails.delay("leak-fail-2", org="f")
    then_probe(5, 1, "leak-fail-2")

    assert [(label, seen) for label, _, _, seen in _rows(db, schema, like="leak-%")] == [
        ("leak-fail", "a"), ("leak-probe-1", None), ("leak-retry", "b"), ("leak-retry", "b"),
        ("leak-probe-2", None), ("leak-reject", "c"), ("leak-probe-3", None),
        ("leak-probe-4", None), ("leak-fail-2", "f"), ("leak-probe-5", None)]
    around = db.execute(
        f'SELECT phase, count(*), count(seen), count(DISTINCT pid) FROM "{schema}".'
        "pgjobs_test_tenant WHERE phase <> 'body' GROUP BY phase ORDER BY phase").fetchall()
    # around every body run (10) and the forged one, whose __call__ refused it: no tenant
    assert around == [("postrun", 11, 0, 1), ("prerun", 11, 0, 1)]
    dead = db.execute(f"SELECT task, error->>'type', error->>'rule' FROM \"{schema}\"."
                      "pgjobs_dead_letter WHERE task = 'record'").fetchall()
    assert dead == [("record", "kombu_pgjobs.errors.TenantMismatch", "terminal")]
    pids = db.execute(f'SELECT count(DISTINCT pid) FROM "{schema}".pgjobs_test_tenant'
                      ).fetchone()[0]
    assert pids == 1, "every task ran on the same child"


# ---------------------------------------------------------------- the docs page

def test_the_code_in_docs_tenancy_runs() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "tenancy.md").read_text("utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert len(blocks) == 3
    ns: dict[str, Any] = {}
    exec(compile(blocks[0], "docs/tenancy.md", "exec"), ns)
    assert ns["sync_orders"](org_id="acme") == "acme"
    assert ns["rebuild_search_index"]() is None
    with pytest.raises(TenantRequired):
        exec(compile("@app.task\ndef forgot() -> None: ...", "forgot", "exec"), ns)
    exec(compile(blocks[1], "docs/tenancy.md", "exec"), ns)
    exec(compile(blocks[2], "docs/tenancy.md", "exec"), ns)
    limits = check_app_limits(ns["app"].conf)
    assert (limits.tenant_limit, limits.tenant_rate) == (10, (100, 60.0))
