"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` package)
driven by Playwright, against the dashboard served by uvicorn on a free port.

Run by ``nox -s browser`` (which installs Chromium when it is missing and sets
``SQLAQ_BROWSER``); elsewhere these tests are skipped, so ``nox -s tests`` needs no
browser. With ``SQLAQ_DASHBOARD_SCREENSHOT`` set, the overview's screenshot is saved
there too (the README's ``docs/dashboard.png``).
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from test_dashboard import SCRIPT, populate

import sqlaq
from sqlaq.dashboard import app as dashboard_app
from tests.helpers import job_row

REQUIRED = bool(os.environ.get("SQLAQ_BROWSER"))
CHROMIUM = os.environ.get("SQLAQ_BROWSER") or shutil.which("chromium") or "/usr/bin/chromium"
if not REQUIRED:
    pytest.importorskip("playwright.sync_api", reason="browser tests run under nox -s browser")
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium: browser tests run under nox -s browser", allow_module_level=True)

import uvicorn  # noqa: E402 - after the skips
from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: The plots' first series' colours (dashboard.js): done, and the wait's p50.
DONE_RGB = (0x2E, 0x85, 0x40)
P50_RGB = (0x1F, 0x6F, 0xEB)

#: Counts the pixels of a canvas within a small distance of an RGB colour.
PIXELS_OF = """([selector, rgb]) => {
  const canvas = document.querySelector(selector);
  const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  let found = 0;
  for (let i = 0; i < data.length; i += 4) {
    if (data[i + 3] > 0 && Math.abs(data[i] - rgb[0]) + Math.abs(data[i + 1] - rgb[1])
        + Math.abs(data[i + 2] - rgb[2]) < 60) found += 1;
  }
  return found;
}"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def served(committed: Engine) -> Iterator[str]:
    """The dashboard, refreshing every second, served by uvicorn in a thread on a port
    of its own; stopped (and the thread joined) after the test."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # connections wait in the backlog until uvicorn accepts them
    config = uvicorn.Config(dashboard_app(committed, refresh=1), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
    assert not thread.is_alive()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1360, "height": 1000})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda error: errors.append(str(error)))
    tab.on("dialog", lambda dialog: errors.append(f"a dialog opened: {dialog.message}"))
    try:
        yield tab
    finally:
        context.close()
    assert errors == []  # no script error, and no alert() from a payload


def status_of(engine: Engine, job_id: int) -> str:
    with engine.connect() as conn:
        return str(job_row(conn, job_id).status)


def test_overview_plots_render_with_data_and_refresh_without_reload(
    page: Page, served: str, committed: Engine, tmp_path: Path
) -> None:
    populate(committed, history=1000)
    with committed.begin() as conn:
        sqlaq.control.pause(conn, "reports", by="ops@laptop")
    try:
        overview(page, served, committed, tmp_path)
    finally:
        with committed.begin() as conn:
            sqlaq.control.resume(conn, "reports")


def overview(page: Page, served: str, committed: Engine, tmp_path: Path) -> None:
    page.goto(served + "/")
    expect(page.locator("#queues tr", has_text="reports")).to_contain_text("paused")
    page.wait_for_function("window.sqlaqDashboard && window.sqlaqDashboard.charts.wait")
    plotted: dict[str, Any] = page.evaluate(
        """() => {
          const c = window.sqlaqDashboard.charts;
          const filled = (d) => d.filter((v) => v !== null && v > 0).length;
          return {points: c.throughput.data[0].length, done: filled(c.throughput.data[1]),
                  failed: filled(c.throughput.data[2]), p50: filled(c.wait.data[1]),
                  p99: filled(c.wait.data[3])};
        }"""
    )
    assert plotted["points"] >= 180
    assert plotted["done"] > 100
    assert plotted["failed"] > 10
    assert plotted["p50"] > 100
    assert plotted["p99"] > 100
    # The lines are drawn: the canvases hold pixels of the series' colours.
    assert page.evaluate(PIXELS_OF, ["#chart-throughput canvas", list(DONE_RGB)]) > 200
    assert page.evaluate(PIXELS_OF, ["#chart-wait canvas", list(P50_RGB)]) > 200

    # Live: a job enqueued now shows up without a reload (the page keeps its state).
    page.evaluate("() => { window.notReloaded = true; }")
    with committed.begin() as conn:
        sqlaq.enqueue(conn, "fresh_kind", {}, queue="live")
    expect(page.locator("#queues")).to_contain_text("live", timeout=15_000)
    assert page.evaluate("() => window.notReloaded === true")
    assert page.evaluate("() => window.sqlaqDashboard.refreshes") >= 1

    shot = page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=False)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    target = os.environ.get("SQLAQ_DASHBOARD_SCREENSHOT")
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_bytes(shot)


def test_filter_the_jobs_list_open_a_job_and_retry_it(
    page: Page, served: str, committed: Engine
) -> None:
    jobs = populate(committed)
    page.goto(served + "/jobs")
    expect(page.locator("#jobs-table tbody tr")).to_have_count(len(jobs))
    page.check("input[name=status][value=failed]")
    page.fill("input[name=kind]", "send_email")
    page.click("#job-filters button[type=submit]")
    page.wait_for_url("**/jobs?status=failed&kind=send_email*")
    rows = page.locator("#jobs-table tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("failed")

    page.click(f"a[href$='/jobs/{jobs['failed']}']")
    page.wait_for_url(f"**/jobs/{jobs['failed']}")
    expect(page.locator("#job-status")).to_have_text("failed")
    assert SCRIPT in page.inner_text("#payload")  # shown as text, never run
    assert SCRIPT in page.inner_text("#last-error")

    page.click("#retry-job")
    page.wait_for_url(f"**/jobs/{jobs['failed']}?did=retried")
    expect(page.locator("#job-status")).to_have_text("queued")
    expect(page.locator(".notice")).to_have_text("Job queued again.")
    assert status_of(committed, jobs["failed"]) == "queued"


def test_retry_a_failure_group_through_its_confirmation(
    page: Page, served: str, committed: Engine
) -> None:
    populate(committed, history=100)  # ten failed with the same TimeoutError
    page.goto(served + "/failures")
    group = page.locator("#failure-groups tbody tr", has_text="TimeoutError")
    expect(group).to_have_count(1)
    expect(group.locator("td").first).to_have_text("10")
    group.locator("a.button").click()
    expect(page.locator("main")).to_contain_text("Queue again 10 failed job(s)")
    page.click("#confirm-retry")
    expect(page.locator("#done-message")).to_have_text("Retried 10 of 10 job(s).")
    page.goto(served + "/failures")
    expect(page.locator("#failure-groups tbody tr", has_text="TimeoutError")).to_have_count(0)
