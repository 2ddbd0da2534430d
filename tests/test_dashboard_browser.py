"""The dashboard in a real browser: headless Chromium (Debian's package) driven by Selenium.

A real ``pgjobs dashboard --write`` server (a subprocess, the token from its environment) over
real Postgres. The browser opens the overview, signs in, filters messages, opens a dead letter
and requeues it through the page's own confirmation dialog; the test then reads the row back
from the database. Under CI=true a missing Chromium or chromedriver fails this test (CI
installs them, see .ci/run); elsewhere it skips with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kombu_pgjobs.store.core import QueueCore
from kombu_pgjobs.store.schema import migrate
from tests.test_cli import claim, in_future, kill_dead, publish

CHROMIUM = os.environ.get("PGJOBS_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("PGJOBS_CHROMEDRIVER", "/usr/bin/chromedriver")
TOKEN = "browser-test-token-0123456789"


def _need_browser() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not (os.access(p, os.X_OK)
                                                          or shutil.which(p))]
    if missing:
        reason = f"headless Chromium is needed: {', '.join(missing)} missing " \
                 "(apt-get install chromium chromium-driver)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def core(db: psycopg.Connection[Any], schema: str) -> QueueCore:
    migrate(db, schema)
    return QueueCore(schema, lease_ttl=60, max_attempts=20, worker="worker-1@host:4242")


@pytest.fixture
def server(core: QueueCore, schema: str, url: str, tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    log = tmp_path / "dashboard.log"
    env = {**os.environ, "PGJOBS_DASHBOARD_TOKEN": TOKEN}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kombu_pgjobs.ops.cli", "dashboard", "--dsn", url, "--schema",
             schema, "--write", "--port", str(port)],
            stdout=fh, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(base + "/", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"dashboard did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def browser() -> Iterator[Any]:
    _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--disable-gpu", "--window-size=1360,860"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(15)  # a loaded CI machine
    try:
        yield driver
    finally:
        driver.quit()


def test_browser_overview_filter_and_requeue_a_dead_letter(
        db: psycopg.Connection[Any], schema: str, core: QueueCore, server: str,
        browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    dead = kill_dead(core, db, "emails", error={
        "type": "SMTPRecipientsRefused", "message": "550 mailbox unavailable",
        "traceback": "Traceback (most recent call last):\n  ...\nSMTPRecipientsRefused"})
    ready = [publish(core, db, "emails", task="app.send_email",
                     tenant=("acme", "globex", "initech")[i % 3]) for i in range(6)]
    claim(core, db, "emails", 2)
    publish(core, db, "emails", task="app.send_email", eta=in_future())
    for _ in range(3):
        publish(core, db, "reports", task="app.build_report", tenant="acme")
    wait = WebDriverWait(browser, 30)

    # the server the CLI runs answers only its own host names (DNS rebinding), with headers
    req = urllib.request.Request(server + "/", headers={"Host": "evil.example"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 400
    with urllib.request.urlopen(server + "/", timeout=10) as r:
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]

    browser.get(server + "/")
    rows = browser.find_elements(By.CSS_SELECTOR, "#queues tbody tr")
    assert [r.find_element(By.CSS_SELECTOR, "td a").text for r in rows] == ["emails", "reports"]
    assert "read-only" not in browser.page_source and "sign in to act" in browser.page_source

    browser.find_element(By.LINK_TEXT, "sign in to act").click()
    browser.find_element(By.NAME, "token").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, ".badge.rw")))

    browser.find_element(By.LINK_TEXT, "Messages").click()
    form = browser.find_element(By.ID, "filters")
    form.find_element(By.NAME, "queue").send_keys("emails")
    Select(form.find_element(By.NAME, "state")).select_by_value("ready")
    form.find_element(By.NAME, "tenant").send_keys("acme")
    form.find_element(By.TAG_NAME, "button").click()
    wait.until(ec.url_contains("state=ready"))
    listed = [int(r.get_attribute("data-id"))
              for r in browser.find_elements(By.CSS_SELECTOR, "#messages tbody tr[data-id]")]
    # the first two were claimed (running); of the rest, acme's: ready[3]
    assert listed == [ready[3]]

    browser.find_element(By.LINK_TEXT, "Dead letters").click()
    browser.find_element(By.LINK_TEXT, str(dead)).click()
    wait.until(ec.url_contains(f"/dead/{dead}"))
    assert "550 mailbox unavailable" in browser.page_source
    browser.find_element(By.XPATH, "//button[text()='requeue']").click()
    alert = wait.until(ec.alert_is_present())
    assert f"Requeue dead letter {dead}" in alert.text
    alert.accept()
    wait.until(ec.presence_of_element_located((By.ID, "result")))
    assert "Done" in browser.page_source

    row = db.execute(f'SELECT queue, state, attempts FROM "{schema}".pgjobs_job WHERE id = %s',
                     [dead]).fetchone()
    assert row == ("emails", "ready", 0)
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter WHERE id = %s',
                      [dead]).fetchone()[0] == 0


def test_browser_bulk_requeue_by_task_moves_only_the_listed_rows(
        db: psycopg.Connection[Any], schema: str, core: QueueCore, server: str,
        browser: Any) -> None:
    """Dead letters filtered by task, "requeue all": the confirmation says how many rows it
    touches (the ones listed), and only those go back to ready; the other task's dead letters
    of the same queue stay dead. The result is a page in words, not a JSON dump."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    boom = [kill_dead(core, db, "shop") for _ in range(3)]
    other = [kill_dead(core, db, "shop") for _ in range(4)]
    db.execute(f'UPDATE "{schema}".pgjobs_dead_letter '
               "SET task = CASE WHEN id = ANY(%s) THEN 'shop.boom' ELSE 'shop.other' END",
               [boom])
    wait = WebDriverWait(browser, 30)
    browser.get(server + "/login")
    browser.find_element(By.NAME, "token").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, ".badge.rw")))

    browser.find_element(By.LINK_TEXT, "Dead letters").click()
    form = browser.find_element(By.CSS_SELECTOR, "form.filters")
    form.find_element(By.NAME, "queue").send_keys("shop")
    form.find_element(By.NAME, "task").send_keys("shop.boom")
    form.find_element(By.TAG_NAME, "button").click()
    wait.until(ec.url_contains("task=shop.boom"))
    listed = sorted(int(r.get_attribute("data-id"))
                    for r in browser.find_elements(By.CSS_SELECTOR, "#dead tbody tr[data-id]"))
    assert listed == sorted(boom)

    browser.find_element(By.XPATH, "//div[@id='bulk']//button[text()='requeue all']").click()
    count = wait.until(ec.presence_of_element_located((By.ID, "count")))
    assert f"This touches {len(listed)} rows" in count.text, count.text
    browser.find_element(By.XPATH, "//form[@id='confirm-form']//button").click()
    done = wait.until(ec.presence_of_element_located((By.ID, "done")))
    assert f"Requeued {len(listed)} dead letters" in done.text
    assert not browser.find_element(By.ID, "result").is_displayed()  # the JSON, folded away

    still_dead = [r[0] for r in db.execute(
        f'SELECT id FROM "{schema}".pgjobs_dead_letter ORDER BY id').fetchall()]
    assert still_dead == sorted(other)
    moved = db.execute(f'SELECT id, state FROM "{schema}".pgjobs_job WHERE id = ANY(%s) '
                       "ORDER BY id", [boom]).fetchall()
    assert moved == [(i, "ready") for i in sorted(boom)]
