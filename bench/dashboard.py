"""Dashboard page times with 1,000,000 rows in the job table; or (``--history``) the on-call
pages with 10,000,000 history rows.

    python -m bench.dashboard [--rows 1000000] [--waiting 100000] [--dead 20000]
                              [--requests 15] [--refill] [--json FILE] [--screenshots DIR]
    python -m bench.dashboard --history 10000000 [--requests 40] [--keep] [--json FILE]

``--history ROWS`` fills its own schema (``bench_dashboard_history``) with ROWS history rows
over the last 7 days (50 tasks, INSERT ... SELECT over generate_series) and their per-minute
rollups up to the last closed minute but one (the watermark there, as the keepers' rollup
leaves it; the minutes since are the unrolled tail), times the tasks page's statement and its
HTTP requests (every window, sorted by rate and by failure ratio), a task's page, the history
search and the workers page, prints median/p95/max, and drops the schema.

Fills schema ``bench_dashboard`` of database ``bench_dashboard`` (created when missing, through
$BENCH_PG_ADMIN_DSN, default postgresql://postgres@127.0.0.1:5432/postgres) with --rows live
messages over 10 queues (about 90 % due, 10 % delayed, 2,000 running under 17 workers;
2,000 tenants; Celery-shaped JSON messages), --dead dead letters, 30 minutes of settle
counters, and then (after a VACUUM, so that the visibility map is a busy table's, not all
visible) --waiting messages parked on one full concurrency key in queue ``flood``. The fill is
INSERT ... SELECT over generate_series (a benchmark fabricates its rows; about a minute on 2
busy cores) and is kept between runs: it is redone only with --refill or when the row count
differs. Then every page is requested --requests times in-process through Starlette's test
client (the app, the pool, Admin's statements and the template, without a socket), after one
warm-up request, and the median, p95 and max are printed per page, as a markdown table.

``--screenshots DIR`` then serves the data set with ``pgjobs dashboard --write`` and saves the
overview, a filtered message list and a dead letter as PNGs from headless Chromium (Debian's
``chromium`` and ``chromium-driver``, through Selenium): the pictures in docs/dashboard.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import psycopg
from starlette.testclient import TestClient

from kombu_pgjobs.ops.dashboard import create_app
from kombu_pgjobs.store.schema import migrate

DB = "bench_dashboard"
SCHEMA = "bench_dashboard"
ADMIN_DSN = os.environ.get("BENCH_PG_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
URL = f"pgjobs://postgres@127.0.0.1:5432/{DB}"
DSN = f"postgresql://postgres@127.0.0.1:5432/{DB}"

FILL = """
INSERT INTO {s}.pgjobs_job (queue, state, priority, run_at, claim, attempts, lease_expires_at,
                            worker, task, created_at, tenant, message)
SELECT 'queue' || (g %% 10),
       CASE WHEN g / 10 %% 500 = 0 THEN 'running' ELSE 'ready' END,
       (g %% 3)::smallint,
       CASE WHEN g / 10 %% 10 = 1 THEN now() + interval '1 hour'
            ELSE now() - interval '1 minute' END,
       CASE WHEN g / 10 %% 500 = 0 THEN 1 ELSE 0 END,
       CASE WHEN g / 10 %% 500 = 0 THEN 1 ELSE 0 END,
       CASE WHEN g / 10 %% 500 = 0 THEN now() + interval '1 hour' END,
       CASE WHEN g / 10 %% 500 = 0 THEN 'worker-' || (g %% 17) || '@bench:1' END,
       'app.task_' || (g %% 25),
       now() - interval '1 hour' + g * interval '1 millisecond',
       'tenant-' || (g %% 2000),
       json_build_object(
         'body', 'W1tdLCB7fSwge31d', 'content-type', 'application/json',
         'content-encoding', 'utf-8',
         'headers', json_build_object('task', 'app.task_' || (g %% 25),
                                      'id', md5(g::text), 'argsrepr', '(' || g || ',)',
                                      'kwargsrepr', '{{}}', 'retries', 0,
                                      'x-pgjobs-tenant', 'tenant-' || (g %% 2000)),
         'properties', json_build_object('body_encoding', 'base64', 'priority', 0,
                                         'delivery_tag', md5(g::text)))
  FROM generate_series(1, %(rows)s) AS g
"""
DEAD = """
INSERT INTO {s}.pgjobs_dead_letter (id, queue, priority, task, claim, attempts, max_attempts,
                                    reason, error, created_at, message)
SELECT nextval(pg_get_serial_sequence('{s}.pgjobs_job', 'id')), 'queue' || (g %% 10), 0,
       'app.task_' || (g %% 25), 3, 3, 3, 'failed',
       jsonb_build_object('type', 'ValueError', 'message', 'bad input ' || g,
                          'traceback', 'Traceback (most recent call last): ...'),
       now() - interval '2 hours',
       json_build_object('body', 'W1tdLCB7fSwge31d', 'content-type', 'application/json',
                         'headers', json_build_object('task', 'app.task_' || (g %% 25),
                                                      'id', md5(g::text),
                                                      'x-pgjobs-tenant', 'tenant-' || (g %% 2000)),
                         'properties', json_build_object('body_encoding', 'base64'))
  FROM generate_series(1, %(dead)s) AS g
"""
FLOOD = """
INSERT INTO {s}.pgjobs_job (queue, state, task, tenant, waiting_on, limit_key, created_at,
                            message)
SELECT 'flood', 'waiting', 'app.sync_account', 'tenant-1', 'key:app.sync_account:acct-1',
       'key:app.sync_account:acct-1', now() - interval '10 minutes',
       json_build_object('headers', json_build_object('task', 'app.sync_account',
                                                      'id', md5('flood' || g)))
  FROM generate_series(1, %(waiting)s) AS g
"""
COUNTERS = """
INSERT INTO {s}.pgjobs_counter (queue, outcome, bucket, shard, n)
SELECT 'queue' || q, o, date_trunc('minute', now()) - m * interval '1 minute', 'bench',
       (100 + 50 * sin(m / 4.0 + q))::bigint * CASE o WHEN 'acked' THEN 10 ELSE 1 END
  FROM generate_series(0, 9) AS q, generate_series(0, 29) AS m,
       unnest(ARRAY['acked', 'dead']) AS o
ON CONFLICT DO NOTHING
"""


def ensure_database() -> None:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DB]).fetchone():
            conn.execute(f'CREATE DATABASE "{DB}"')


def fill(rows: int, dead: int, waiting: int, refill: bool) -> None:
    s = f'"{SCHEMA}"'
    with psycopg.connect(DSN, autocommit=True) as conn:
        migrate(conn, SCHEMA)
        have = conn.execute(f"SELECT count(*) FROM {s}.pgjobs_job").fetchone()[0]
        if have == rows + waiting and not refill:
            print(f"kept: {have} rows", file=sys.stderr)
            return
        started = time.monotonic()
        conn.execute(f"TRUNCATE {s}.pgjobs_job, {s}.pgjobs_dead_letter, {s}.pgjobs_counter")
        conn.execute(FILL.format(s=s), {"rows": rows})  # type: ignore[arg-type]
        conn.execute(DEAD.format(s=s), {"dead": dead})  # type: ignore[arg-type]
        conn.execute(COUNTERS.format(s=s))  # type: ignore[arg-type]
        conn.execute(f"VACUUM ANALYZE {s}.pgjobs_job")
        conn.execute(f"VACUUM ANALYZE {s}.pgjobs_dead_letter")
        # then a flood parked on one key, written into the free space of pages all over the
        # table, as a live queue's churn does: index-only reads visit the heap again
        conn.execute(FLOOD.format(s=s), {"waiting": waiting})  # type: ignore[arg-type]
        conn.execute(f"ANALYZE {s}.pgjobs_job")
        print(f"filled {rows} + {waiting} rows, {dead} dead letters in "
              f"{time.monotonic() - started:.1f} s", file=sys.stderr)


def pages() -> list[tuple[str, str]]:
    with psycopg.connect(DSN) as conn:
        s = f'"{SCHEMA}"'
        # a running message a thousand in (or the last one, on a small --rows)
        mid = conn.execute(f"SELECT coalesce((SELECT id FROM {s}.pgjobs_job "
                           "WHERE state = 'running' ORDER BY id OFFSET 1000 LIMIT 1), "
                           f"(SELECT max(id) FROM {s}.pgjobs_job WHERE state = 'running'))"
                           ).fetchone()[0]
        dead = conn.execute(f"SELECT max(id) FROM {s}.pgjobs_dead_letter").fetchone()[0]
        deep = conn.execute(f"SELECT id FROM {s}.pgjobs_job ORDER BY id OFFSET 900000 LIMIT 1"
                            ).fetchone()
    after = deep[0] if deep else mid
    return [
        ("overview", "/"),
        ("messages (all live)", "/messages"),
        ("messages, page far in (after=id 900,000th)", f"/messages?after={after}"),
        ("messages ?queue=queue3&state=ready", "/messages?queue=queue3&state=ready"),
        ("messages ?state=running", "/messages?state=running"),
        ("messages ?state=delayed", "/messages?state=delayed"),
        ("messages ?tenant=tenant-42", "/messages?tenant=tenant-42"),
        ("messages ?task=app.task_7", "/messages?task=app.task_7"),
        ("messages ?state=dead", "/messages?state=dead"),
        ("messages ?state=waiting", "/messages?state=waiting"),
        ("message page", f"/messages/{mid}"),
        ("dead letters", "/dead"),
        ("dead letters ?queue=queue3", "/dead?queue=queue3"),
        ("dead letter page", f"/dead/{dead}"),
        ("limits", "/limits"),
        ("workers", "/workers"),
        ("tenants (by name, counts bounded)", "/tenants"),
    ]


def measure(requests: int) -> list[dict[str, Any]]:
    app = create_app(URL, schema=SCHEMA, pool_size=2)
    out = []
    with TestClient(app) as client:
        for name, path in pages():
            client.get(path)  # warm-up: the pool's connection, the template's compile
            times = []
            for _ in range(requests):
                t = time.perf_counter()
                r = client.get(path)
                times.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200, (path, r.status_code, r.text[:300])
            times.sort()
            out.append({"page": name, "path": path, "median_ms": statistics.median(times),
                        "p95_ms": times[min(len(times) - 1, int(len(times) * 0.95))],
                        "max_ms": times[-1]})
    return out


def screenshots(directory: str) -> None:
    import subprocess
    import urllib.request
    from pathlib import Path

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    s = f'"{SCHEMA}"'
    with psycopg.connect(DSN, autocommit=True) as conn:  # fresh minutes for the chart
        conn.execute(f"DELETE FROM {s}.pgjobs_counter")
        conn.execute(COUNTERS.format(s=s).replace("%%", "%"))  # type: ignore[arg-type]
        conn.execute(f"INSERT INTO {s}.pgjobs_queue (name, paused) VALUES ('queue7', true) "
                     "ON CONFLICT (name) DO UPDATE SET paused = true")
        dead = conn.execute(f"SELECT max(id) FROM {s}.pgjobs_dead_letter").fetchone()[0]
    token = "screenshot-token-0123456789"
    server = subprocess.Popen(
        [sys.executable, "-m", "kombu_pgjobs.ops.cli", "dashboard", "--dsn", URL, "--schema",
         SCHEMA, "--write", "--port", "8799"], env={**os.environ, "PGJOBS_DASHBOARD_TOKEN": token})
    base = "http://127.0.0.1:8799"
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1360,760", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = None
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(base + "/", timeout=5).close()
                break
            except OSError:
                time.sleep(0.3)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        driver.get(base + "/login")
        driver.find_element(By.NAME, "token").send_keys(token)
        driver.find_element(By.CSS_SELECTOR, "#login button").click()
        WebDriverWait(driver, 10).until(
            ec.presence_of_element_located((By.CSS_SELECTOR, ".badge.rw")))
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for name, path in (("overview", "/"),
                           ("messages", "/messages?queue=queue3&state=ready&tenant=tenant-3"),
                           ("dead-letter", f"/dead/{dead}")):
            driver.get(base + path)
            driver.save_screenshot(str(out / f"dashboard-{name}.png"))
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(10)
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(f"UPDATE {s}.pgjobs_queue SET paused = false WHERE name = 'queue7'")


#: the history scenario's own schema (dropped at the end unless --keep)
HISTORY_SCHEMA = "bench_dashboard_history"
#: --history rows spread over the last 7 days (the default retention), 50 tasks, each task's
#: failure ratio its own (task k fails about 2k in 997), runtimes 0 to 10 s by task
HISTORY_FILL = """
INSERT INTO {s}.pgjobs_history (settled_at, job_id, claim, task, queue, tenant, outcome,
                                runtime, attempts, worker)
SELECT now() - (%(rows)s - g) * (interval '7 days' / %(rows)s), g, 1,
       'app.task_' || lpad((g %% 50)::text, 2, '0'), 'queue' || (g %% 10),
       'tenant-' || (g %% 2000),
       CASE WHEN g %% 997 < (g %% 50) * 2 THEN 'failed'
            WHEN g %% 1009 = 0 THEN 'requeued' ELSE 'completed' END,
       ((g %% 1000) / 100.0 * (1 + (g %% 50) / 50.0))::real, 1,
       'worker-' || (g %% 17) || '@bench:' || (1000 + g %% 17) || ':1'
  FROM generate_series(1, %(rows)s) AS g
"""
#: the rollups of every closed minute but the last, as the keepers' rollup writes them (a
#: minute's rows together, minute after minute: the table's order on disk is the keepers')
HISTORY_ROLLUP = """
INSERT INTO {s}.pgjobs_task_minute AS m
       (task, minute, completed, failed, dropped, cancelled, requeued,
        runtime_p50, runtime_p95, runtime_max)
SELECT coalesce(h.task, ''), date_trunc('minute', h.settled_at),
       count(*) FILTER (WHERE h.outcome = 'completed'),
       count(*) FILTER (WHERE h.outcome = 'failed'),
       count(*) FILTER (WHERE h.outcome = 'dropped'),
       count(*) FILTER (WHERE h.outcome = 'cancelled'),
       count(*) FILTER (WHERE h.outcome = 'requeued'),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY h.runtime),
       percentile_cont(0.95) WITHIN GROUP (ORDER BY h.runtime),
       max(h.runtime)
  FROM {s}.pgjobs_history AS h
 WHERE h.settled_at < date_trunc('minute', now()) - interval '1 minute'
 GROUP BY 1, 2
 ORDER BY 2, 1
"""


def _pct(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"median_ms": statistics.median(times),
            "p95_ms": times[min(len(times) - 1, int(len(times) * 0.95))], "max_ms": times[-1]}


def _fill_history(s: str, rows: int) -> None:
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {s} CASCADE")
        migrate(conn, HISTORY_SCHEMA)
        started = time.monotonic()
        conn.execute(HISTORY_FILL.format(s=s), {"rows": rows})  # type: ignore[arg-type]
        filled = time.monotonic()
        conn.execute(HISTORY_ROLLUP.format(s=s))  # type: ignore[arg-type]
        conn.execute(f"UPDATE {s}.pgjobs_rollup SET upto = date_trunc('minute', now()) "
                     "- interval '1 minute'")
        conn.execute(f"VACUUM ANALYZE {s}.pgjobs_history")
        conn.execute(f"VACUUM ANALYZE {s}.pgjobs_task_minute")
        n_rollups = conn.execute(f"SELECT count(*) FROM {s}.pgjobs_task_minute").fetchone()[0]
        print(f"filled {rows:,} history rows in {filled - started:.1f} s, {n_rollups:,} "
              f"rollups in {time.monotonic() - filled:.1f} s", file=sys.stderr)


def history_scenario(rows: int, requests: int, keep: bool) -> list[dict[str, Any]]:
    """The tasks page with ``rows`` history rows: fill schema :data:`HISTORY_SCHEMA` (history
    over 7 days, its rollups up to the last closed minute but one, the watermark there, as a
    keeper leaves them), then time the tasks page's statement and HTTP requests (each window,
    sorted two ways), a task's page and the history search; drop the schema."""
    from kombu_pgjobs.ops.dashboard.oncall import WINDOWS
    from kombu_pgjobs.store.history import TAIL
    from kombu_pgjobs.store.sql import queries as store_queries

    s = f'"{HISTORY_SCHEMA}"'
    out: list[dict[str, Any]] = []
    with psycopg.connect(DSN, autocommit=True) as conn:
        have = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                            [f"{s}.pgjobs_history"]).fetchone()[0] and conn.execute(
            f"SELECT count(*) FROM {s}.pgjobs_history").fetchone()[0]
        reused = keep and have == rows
    if reused:  # a --keep run's fill (its newest minutes are as old as that run)
        print(f"kept: {rows:,} history rows", file=sys.stderr)
    else:
        _fill_history(s, rows)
    try:
        # the statement alone, on the dashboard's own session settings (jit, bitmap scans off)
        with psycopg.connect(DSN, autocommit=True,
                             options="-c jit=off -c enable_bitmapscan=off") as conn:
            q = store_queries(HISTORY_SCHEMA)["history_tasks"]
            for window, (minutes, points) in WINDOWS.items():
                for sort in ("rate", "failure"):
                    params = {"minutes": minutes, "points": points, "tail": TAIL,
                              "sort": sort, "descending": True, "limit": 500}
                    conn.execute(q, params).fetchall()
                    times = []
                    for _ in range(requests):
                        t = time.perf_counter()
                        got = conn.execute(q, params).fetchall()
                        times.append((time.perf_counter() - t) * 1000)
                    assert len(got) == 50, len(got)
                    out.append({"page": f"statement history_tasks window={window} "
                                        f"sort={sort}", **_pct(times)})
        app = create_app(URL, schema=HISTORY_SCHEMA, pool_size=2)
        paths = [f"/tasks?window={w}&sort={o}" for w in WINDOWS for o in ("rate", "failure")]
        paths += ["/tasks/app.task_07", "/tasks/app.task_07?outcome=failed", "/history",
                  "/history?tenant=tenant-42", "/history?task=app.task_07&outcome=failed",
                  "/workers"]
        with TestClient(app) as client:
            for path in paths:
                client.get(path)  # warm-up
                times = []
                for _ in range(requests):
                    t = time.perf_counter()
                    r = client.get(path)
                    times.append((time.perf_counter() - t) * 1000)
                    assert r.status_code == 200, (path, r.status_code, r.text[:300])
                out.append({"page": f"GET {path}", **_pct(times)})
    finally:
        if not keep:
            with psycopg.connect(DSN, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {s} CASCADE")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dead", type=int, default=20_000)
    p.add_argument("--waiting", type=int, default=100_000,
                   help="messages parked on one full key, in queue 'flood'")
    p.add_argument("--requests", type=int, default=15)
    p.add_argument("--json", metavar="FILE", help="also write the figures here")
    p.add_argument("--screenshots", metavar="DIR", help="then save the docs' screenshots here")
    p.add_argument("--refill", action="store_true")
    p.add_argument("--history", type=int, metavar="ROWS",
                   help="instead: the tasks page with ROWS history rows (10,000,000 for "
                        "docs/benchmarks.md) in schema bench_dashboard_history, dropped after")
    p.add_argument("--keep", action="store_true",
                   help="with --history: keep the schema, and use a kept one of ROWS rows")
    args = p.parse_args(argv)
    ensure_database()
    if args.history:
        results = history_scenario(args.history, args.requests, args.keep)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"history_rows": args.history, "pages": results}, fh, indent=2)
        print(f"| {args.history:,} history rows (7 days, 50 tasks) | median ms | p95 ms "
              "| max ms |")
        print("|---|---:|---:|---:|")
        for r in results:
            print(f"| {r['page']} | {r['median_ms']:.1f} | {r['p95_ms']:.1f} "
                  f"| {r['max_ms']:.1f} |")
        return 0
    fill(args.rows, args.dead, args.waiting, args.refill)
    results = measure(args.requests)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": args.rows, "waiting": args.waiting, "dead": args.dead,
                       "pages": results}, fh, indent=2)
    print(f"| page ({args.rows + args.waiting:,} rows in pgjobs_job ({args.waiting:,} waiting), "
          f"{args.dead:,} dead letters) "
          "| median ms | p95 ms | max ms |")
    print("|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['page']} | {r['median_ms']:.1f} | {r['p95_ms']:.1f} | {r['max_ms']:.1f} |")
    if args.screenshots:
        screenshots(args.screenshots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
