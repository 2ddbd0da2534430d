"""The on-call pages in a real browser (issue 34, item 4): headless Chromium driven by Selenium
against a real ``pgjobs dashboard --write`` server over real Postgres (the harness of
tests/test_dashboard_browser.py: its fixtures).

The operator opens the tasks page, sorts it by failure ratio, opens the failing task, ticks two
of its failures' dead letters and requeues them through the confirmation page; the audit page
then shows the action with those two ids. The test reads the rows back from the database.
"""

from __future__ import annotations

from typing import Any

import psycopg

from kombu_pgjobs.store.core import QueueCore
from tests.test_cli import claim, publish
from tests.test_dashboard_browser import TOKEN, browser, core, server  # noqa: F401


def _settle(queues: QueueCore, db: psycopg.Connection[Any], task: str, ok: int,
            failed: int) -> list[int]:
    """``ok`` completions and ``failed`` failures (dead letters) of ``task``, settled by the
    transport's own statements; the failures' ids, oldest first."""
    dead = []
    for i in range(ok + failed):
        job_id = publish(queues, db, "shop", task=task)
        pairs = [p for p in claim(queues, db, "shop", 50) if p[0] == job_id]
        if i < ok:
            assert queues.ack(db, pairs) == {job_id}
        else:
            assert queues.bury(db, pairs, reason="rejected", error={
                "type": "CardDeclined", "message": f"card {i} declined"}) == {job_id}
            dead.append(job_id)
    return dead


def test_browser_tasks_sort_open_select_two_dead_letters_requeue_then_audit(
        db: psycopg.Connection[Any], schema: str, core: QueueCore, server: str,  # noqa: F811
        browser: Any) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    _settle(core, db, "shop.add", 8, 0)
    ship = _settle(core, db, "shop.ship", 4, 1)
    failures = _settle(core, db, "shop.charge", 2, 3)
    wait = WebDriverWait(browser, 30)

    browser.get(server + "/login")
    browser.find_element(By.NAME, "token").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, ".badge.rw")))

    browser.find_element(By.LINK_TEXT, "Tasks").click()
    wait.until(ec.presence_of_element_located((By.ID, "tasks")))
    rows = browser.find_elements(By.CSS_SELECTOR, "#tasks tbody tr[data-task]")
    assert [r.get_attribute("data-task") for r in rows] == ["shop.add", "shop.charge",
                                                            "shop.ship"]  # by rate
    browser.find_element(By.CSS_SELECTOR, "#tasks th a[data-sort='failure']").click()
    wait.until(ec.url_contains("sort=failure"))
    rows = browser.find_elements(By.CSS_SELECTOR, "#tasks tbody tr[data-task]")
    assert [r.get_attribute("data-task") for r in rows] == ["shop.charge", "shop.ship",
                                                            "shop.add"]
    assert rows[0].find_element(By.CSS_SELECTOR, "td[data-col='failure']").text == "60.0%"

    rows[0].find_element(By.LINK_TEXT, "shop.charge").click()
    wait.until(ec.url_contains("/tasks/shop.charge"))
    linked = [int(a.text) for a in browser.find_elements(By.CSS_SELECTOR, "#history a.dead-link")]
    assert sorted(linked) == sorted(failures)
    chosen = failures[:2]
    for dead_id in chosen:
        browser.find_element(By.CSS_SELECTOR, f"input[name='pick'][value='{dead_id}']").click()
    browser.find_element(By.ID, "requeue-selected").click()
    count = wait.until(ec.presence_of_element_located((By.ID, "count")))
    assert "This touches 2 rows" in count.text, count.text
    browser.find_element(By.XPATH, "//form[@id='confirm-form']//button").click()
    done = wait.until(ec.presence_of_element_located((By.ID, "done")))
    assert "Requeued 2 dead letters" in done.text

    browser.find_element(By.LINK_TEXT, "Audit").click()
    audit = wait.until(ec.presence_of_element_located((By.ID, "audit")))
    first = audit.find_element(By.CSS_SELECTOR, "tbody tr")
    assert "dead requeue" in first.text and "session" in first.text
    assert all(str(i) in first.text for i in chosen), first.text

    still = [r[0] for r in db.execute(
        f'SELECT id FROM "{schema}".pgjobs_dead_letter ORDER BY id').fetchall()]
    assert still == sorted([*ship, failures[2]])  # the rows not ticked stay dead
    back = db.execute(f'SELECT id, state FROM "{schema}".pgjobs_job WHERE id = ANY(%s) '
                      "ORDER BY id", [chosen]).fetchall()
    assert back == [(i, "ready") for i in sorted(chosen)]
    target = db.execute(f'SELECT action, target ->> \'ids\', rows FROM "{schema}".pgjobs_audit'
                        ).fetchall()
    assert len(target) == 1 and target[0][0] == "dead requeue" and target[0][2] == 2
    assert sorted(map(int, target[0][1].split(","))) == sorted(chosen)
