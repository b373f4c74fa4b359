"""The web dashboard over HTTP (Starlette's test client), against the real database:
every page and action, bad input (400), escaping, CSRF, read-only mode, a missing
schema, a host's mount point, the plans of the overview's queries, and the ``sqlaq
dashboard`` command serving it."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from html import unescape
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, event, text
from starlette.applications import Starlette
from starlette.routing import Mount

import sqlaq
from sqlaq import admin, queries
from sqlaq.dashboard import app as dashboard_app
from sqlaq.dashboard import csrf, reads
from tests.helpers import finish_long_ago, job_row

with warnings.catch_warnings():
    # Starlette 1.x suggests the httpx2 fork for its test client; httpx still works.
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from starlette.testclient import TestClient

#: Where the test client sends its requests: a host name the dashboard answers by
#: default (Starlette's ``testserver`` is not one).
LOCAL = "http://localhost"
#: What the failed job's payload and error hold: both must be shown as text.
SCRIPT = "<script>alert('sqlaq')</script>"
ERROR = f"ValueError: bad address {SCRIPT}\nTraceback (most recent call last):\n  File x"


def populate(engine: Engine, history: int = 0) -> dict[str, int]:
    """A job in every status (the failed one's payload and error hold a script tag);
    with *history*, that many finished jobs more, about one every 10 s (in waves) back
    from now, so the plots have data (every tenth failed with the same error, the rest
    done; waits of 0.2 to 31 s)."""
    worker = uuid.uuid4()
    ids: dict[str, int] = {}
    with engine.begin() as conn:
        enqueue = sqlaq.enqueue
        ids["failed"] = enqueue(conn, "send_email", {"note": SCRIPT}, max_attempts=1).job_id
        ids["done"] = enqueue(conn, "send_email", {"user_id": 8}).job_id
        claimed = {job.id: job for job in sqlaq.claim(conn, worker_id=worker, limit=2)}
        sqlaq.complete(conn, [claimed[ids["done"]].lease])
        sqlaq.fail(conn, claimed[ids["failed"]].lease, ERROR)
        ids["cancelled"] = enqueue(conn, "resize_image", {"image": 3}).job_id
        sqlaq.cancel(conn, [ids["cancelled"]])
        ids["running"] = enqueue(conn, "resize_image", {"image": 4}, queue="media").job_id
        sqlaq.claim(conn, worker_id=worker, queue="media", limit=1)
        ids["queued"] = enqueue(conn, "build_report", {"report": 5}, queue="reports").job_id
        if history:
            conn.execute(text("SELECT setseed(0.42)"))  # random() below: the same each run
            conn.execute(
                text(
                    "INSERT INTO sqlaq_jobs (queue, kind, status, attempts, created_at,"
                    " attempted_at, finished_at, run_at, last_error)"
                    " SELECT 'default', 'send_email',"
                    " CASE WHEN n % 10 = 0 THEN 'failed' ELSE 'done' END, 1,"
                    " t - interval '1 second' * (0.2 + 3 * (1 + sin(n / 70.0))"
                    " + 25 * power(random(), 4)), t, t + interval '200 milliseconds', t,"
                    " CASE WHEN n % 10 = 0 THEN 'TimeoutError: the mail server did not"
                    " answer' || chr(10) || '  File mail.py' END"
                    " FROM (SELECT n, now() - interval '10 seconds' * (n + 24 * sin(n / 40.0))"
                    " AS t FROM generate_series(1, :n) AS n) AS h"
                ),
                {"n": history},
            )
    return ids


@pytest.fixture
def jobs(committed: Engine) -> dict[str, int]:
    return populate(committed)


@pytest.fixture
def client(committed: Engine) -> Iterator[TestClient]:
    with TestClient(dashboard_app(committed), base_url=LOCAL) as c:
        yield c


def token(client: TestClient, path: str = "/") -> str:
    """Load a page (which sets the CSRF cookie) and return the token of its forms."""
    client.get(path)
    value = client.cookies.get(csrf.COOKIE)
    assert value
    return value


def status_of(engine: Engine, job_id: int) -> str:
    with engine.connect() as conn:
        return str(job_row(conn, job_id).status)


def pre(page: str, element_id: str) -> str:
    """The text of the page's ``<pre id=...>``, unescaped."""
    found = re.search(rf'<pre class="[^"]*" id="{element_id}">(.*?)</pre>', page, re.S)
    assert found, page
    return unescape(found.group(1))


def embedded_series(html: str) -> dict[str, Any]:
    found = re.search(r'<script type="application/json" id="overview-data">(.*?)</script>', html)
    assert found, html
    return dict(json.loads(found.group(1)))


# -- overview ------------------------------------------------------------------------


def test_overview_shows_counts_health_and_plot_data(client: TestClient, committed: Engine) -> None:
    populate(committed, history=600)  # and finished jobs over the last 100 minutes
    response = client.get("/")
    assert response.status_code == 200
    html = response.text
    assert re.search(r'<td>reports</td>\s*<td>build_report</td>\s*<td class="num"><a', html)
    assert "/jobs?queue=media" in html
    series = embedded_series(html)
    assert series["hours"] == 3
    assert series["bucket_seconds"] == 60
    throughput = series["throughput"]
    assert len(throughput["t"]) == len(throughput["done"]) >= 180
    assert sum(throughput["done"]) > 0
    assert sum(throughput["failed"]) > 0
    wait = series["wait"]
    measured = [v for v in wait["p50"] if v is not None]
    assert measured
    assert all(0 <= v <= 32 for v in measured)
    assert all(
        p50 <= p99 for p50, p99 in zip(wait["p50"], wait["p99"], strict=True) if p50 is not None
    )


def test_overview_counts_finished_jobs_of_the_range_only(
    client: TestClient, committed: Engine, jobs: dict[str, int]
) -> None:
    with committed.begin() as conn:
        finish_long_ago(conn, jobs["done"], "done", "5 hours")
    api = client.get("/api/overview", params={"hours": 3}).json()
    assert 'href="/jobs?status=done"><span class="n">0</span>' in api["tables"]
    api = client.get("/api/overview", params={"hours": 6}).json()
    assert 'href="/jobs?status=done"><span class="n">1</span>' in api["tables"]


def test_overview_api_returns_the_series_and_the_tables(
    client: TestClient, jobs: dict[str, int]
) -> None:
    data = client.get("/api/overview", params={"hours": "24"}).json()
    assert data["hours"] == 24
    assert data["bucket_seconds"] == 600
    assert set(data["throughput"]) == {"t", "done", "failed", "cancelled"}
    assert set(data["wait"]) == {"t", "count", "p50", "p90", "p99"}
    assert sum(data["throughput"]["done"]) > 0  # the done job, a minute ago at most
    assert '<table class="grid" id="queues">' in data["tables"]
    assert "&lt;script&gt;" not in data["tables"]  # no payload or error on the overview


@pytest.mark.parametrize("hours", ["5", "abc", "0", "-1", "1e9", "99999999999999999999"])
def test_a_bad_range_is_a_400_with_a_message(client: TestClient, hours: str) -> None:
    page = client.get("/", params={"hours": hours})
    assert page.status_code == 400
    assert "hours" in page.text
    assert "Traceback" not in page.text
    api = client.get("/api/overview", params={"hours": hours})
    assert api.status_code == 400
    assert api.json()["error"].startswith("hours")


# -- jobs list -----------------------------------------------------------------------


def test_jobs_list_filters_like_sqlaq_list(client: TestClient, jobs: dict[str, int]) -> None:
    def listed(**params: Any) -> list[int]:
        response = client.get("/jobs", params=params)
        assert response.status_code == 200, response.text
        return [
            int(i) for i in re.findall(r'<td class="num"><a href="/jobs/(\d+)">', response.text)
        ]

    assert listed() == sorted(jobs.values(), reverse=True)
    assert listed(status="failed") == [jobs["failed"]]
    assert listed(status=["queued", "running"]) == [jobs["queued"], jobs["running"]]
    assert listed(kind="resize_image") == [jobs["running"], jobs["cancelled"]]
    assert listed(queue="reports") == [jobs["queued"]]
    assert listed(kind="send_email", status="done") == [jobs["done"]]
    assert listed(since="1h", kind="", queue="") == sorted(jobs.values(), reverse=True)
    assert listed(kind="nothing") == []


def test_jobs_list_pages_by_id_without_offset(client: TestClient, committed: Engine) -> None:
    with committed.begin() as conn:
        ids = [r.job_id for r in sqlaq.enqueue_many(conn, [sqlaq.NewJob("k")] * 7)]
    newest = sorted(ids, reverse=True)
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(committed, "before_cursor_execute", record)
    try:
        first = client.get("/jobs", params={"limit": 3}).text
        assert re.findall(r'href="/jobs/(\d+)"', first) == [str(i) for i in newest[:3]]
        older = re.search(r'href="(/jobs\?[^"]*before=\d+)" rel="next"', first)
        assert older, first
        second = client.get(older.group(1).replace("&amp;", "&")).text
        assert re.findall(r'href="/jobs/(\d+)"', second) == [str(i) for i in newest[3:6]]
        newer = re.search(r'href="(/jobs\?[^"]*after=\d+)" rel="prev"', second)
        assert newer, second
        back = client.get(newer.group(1).replace("&amp;", "&")).text
        assert re.findall(r'href="/jobs/(\d+)"', back) == [str(i) for i in newest[:3]]
        last = client.get("/jobs", params={"limit": 3, "before": newest[5]}).text
        assert re.findall(r'href="/jobs/(\d+)"', last) == [str(newest[6])]
        assert 'rel="next"' not in last
    finally:
        event.remove(committed, "before_cursor_execute", record)
    assert statements
    assert not any("OFFSET" in s.upper() for s in statements)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"status": "bogus"}, "status: invalid status 'bogus'"),
        ({"limit": "0"}, "limit must be between 1 and 500"),
        ({"limit": "501"}, "limit must be between 1 and 500"),
        ({"limit": "ten"}, "limit: invalid integer"),
        ({"before": "-3"}, "before must be between 1"),
        ({"before": "99999999999999999999"}, "before must be between 1"),
        ({"before": "5", "after": "2"}, "give one of them, not both"),
        ({"since": "yesterday"}, "since: invalid duration"),
        ({"since": "1000000d"}, "since must be at most 100 years"),
        ({"kind": "a\x00b"}, "NUL"),
    ],
)
def test_a_bad_filter_is_a_400_with_a_message(
    client: TestClient, params: dict[str, str], message: str
) -> None:
    response = client.get("/jobs", params=params)
    assert response.status_code == 400
    assert message in response.text.replace("&#39;", "'")
    assert "Traceback" not in response.text


# -- job page ------------------------------------------------------------------------


def test_job_page_shows_everything_escaped(
    client: TestClient, committed: Engine, jobs: dict[str, int]
) -> None:
    response = client.get(f"/jobs/{jobs['failed']}")
    assert response.status_code == 200
    html = response.text
    assert SCRIPT not in html  # neither from the payload nor from the error
    assert "&lt;script&gt;alert(&#39;sqlaq&#39;)&lt;/script&gt;" in html
    assert pre(html, "payload") == json.dumps({"note": SCRIPT}, indent=2)
    assert pre(html, "last-error") == ERROR  # in full
    assert 'id="retry-job"' in html
    assert 'id="cancel-job"' not in html
    assert "1 of 1" in html  # attempts
    running = client.get(f"/jobs/{jobs['running']}").text
    assert "lease ends" in running
    assert 'id="cancel-job"' in running


def test_job_page_draws_its_workflow_with_every_edge_escaped(
    client: TestClient, committed: Engine, jobs: dict[str, int]
) -> None:
    with committed.begin() as conn:
        root = sqlaq.enqueue(conn, "root").job_id
        chord = sqlaq.chord(
            conn,
            [sqlaq.NewJob("count", {"n": n}) for n in range(3)],
            sqlaq.NewJob(f"sum{SCRIPT}"),
            after=[root],
        )
        finish_long_ago(conn, root, "done", "1 minute")
    assert chord.callback_id is not None
    html = client.get(f"/jobs/{chord.job_ids[1]}").text
    assert SCRIPT not in html
    assert 'id="workflow-graph"' in html
    drawn = re.findall(r'<a href="[^"]*/jobs/(\d+)" class="wf-node wf-(\w+)( wf-current)?"', html)
    assert [(int(i), status, bool(cur)) for i, status, cur in drawn] == [
        (root, "done", False),
        (chord.job_ids[0], "queued", False),
        (chord.job_ids[1], "queued", True),
        (chord.job_ids[2], "queued", False),
        (chord.callback_id, "waiting", False),
    ]
    # root -> each member, each member -> the callback.
    assert html.count('class="wf-edge"') == 6
    assert "sum&lt;script&gt;" in html
    table = html[html.index('id="workflow-jobs"') :]
    assert ", ".join(f'<a href="/jobs/{m}">{m}</a>' for m in chord.job_ids) in table
    assert 'id="workflow-more"' not in html
    # A job outside any workflow has no such section.
    assert 'id="workflow"' not in client.get(f"/jobs/{jobs['queued']}").text


def test_a_large_workflow_is_drawn_in_part_with_how_many_more(
    client: TestClient, committed: Engine
) -> None:
    members = reads.WORKFLOW_SHOWN + 5
    with committed.begin() as conn:
        chord = sqlaq.chord(conn, [sqlaq.NewJob("count")] * members, sqlaq.NewJob("sum"))
    html = client.get(f"/jobs/{chord.callback_id}").text
    assert html.count('class="wf-node') == reads.WORKFLOW_SHOWN
    more = re.search(r'id="workflow-more">([\d,]+) more jobs', html)
    assert more is not None
    assert int(more[1]) == members + 1 - reads.WORKFLOW_SHOWN


def test_a_workflow_too_slow_to_walk_is_not_drawn_and_the_page_stands(
    client: TestClient, committed: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with committed.begin() as conn:
        chord = sqlaq.chord(conn, [sqlaq.NewJob("count")] * 3, sqlaq.NewJob("sum"))
    # A walk slower than its timeout: the parents index makes a real one fast whatever
    # the table holds, so a sleep runs first in the walk's own statement timeout.
    walk = reads.ops.read_workflow

    def slow_walk(conn: Connection, job_id: int, **options: Any) -> Any:
        conn.execute(text("SELECT pg_sleep(0.2)"))
        return walk(conn, job_id, **options)

    monkeypatch.setattr(reads.ops, "read_workflow", slow_walk)
    monkeypatch.setattr(reads, "WORKFLOW_TIMEOUT", "20ms")
    response = client.get(f"/jobs/{chord.job_ids[0]}")
    assert response.status_code == 200
    assert 'id="workflow-slow"' in response.text
    assert 'id="workflow-graph"' not in response.text
    assert pre(response.text, "payload") == "{}"
    monkeypatch.setattr(reads, "WORKFLOW_TIMEOUT", "60s")
    assert 'id="workflow-graph"' in client.get(f"/jobs/{chord.job_ids[0]}").text


def test_job_page_shows_a_result_when_the_table_stores_one(
    client: TestClient, committed: Engine, jobs: dict[str, int]
) -> None:
    if "result" not in sqlaq.jobs.c:
        pytest.skip("this schema has no result column")
    with committed.begin() as conn:
        conn.execute(
            text("UPDATE sqlaq_jobs SET result = CAST(:r AS jsonb) WHERE id = :id"),
            {"r": json.dumps({"sent": SCRIPT}), "id": jobs["done"]},
        )
    html = client.get(f"/jobs/{jobs['done']}").text
    assert pre(html, "result") == json.dumps({"sent": SCRIPT}, indent=2)
    assert 'id="result"' not in client.get(f"/jobs/{jobs['queued']}").text


def big_job(engine: Engine, size: int) -> int:
    """A failed job whose payload, result and error each hold *size* characters or
    more (with a script tag at the end, past what a page shows)."""
    filler = "x" * size
    with engine.begin() as conn:
        job_id = sqlaq.enqueue(conn, "big", {"blob": filler, "tail": SCRIPT}).job_id
        conn.execute(
            text(
                "UPDATE sqlaq_jobs SET status = 'failed', finished_at = now(), attempts = 1,"
                " result = CAST(:r AS jsonb), last_error = :e WHERE id = :id"
            ),
            {
                "r": json.dumps({"rows": filler, "tail": SCRIPT}),
                "e": f"MemoryError: {filler}\n{SCRIPT}",
                "id": job_id,
            },
        )
    return job_id


def test_a_job_page_cuts_large_values_and_links_to_the_whole(
    client: TestClient, committed: Engine
) -> None:
    job_id = big_job(committed, 300_000)
    response = client.get(f"/jobs/{job_id}")
    assert response.status_code == 200
    html = response.text
    assert len(html) < 3 * reads.SHOWN + 20_000  # three values cut, not 900 kB
    payload, result, error = (pre(html, name) for name in ("payload", "result", "last-error"))
    assert len(payload) == len(result) == len(error) == reads.SHOWN
    assert payload.startswith('{"blob": "xxx')  # the start of its JSON text
    assert result.startswith('{"rows": "xxx')
    assert error.startswith("MemoryError: xxx")
    for name, field in (("payload", "payload"), ("result", "result"), ("last-error", "last_error")):
        assert f'id="{name}-cut"' in html
        assert "Only the first 65,536 characters are shown." in html
        link = re.search(rf'<a href="([^"]+)" id="{name}-raw" download>', html)
        assert link, name
        assert link.group(1) == f"/jobs/{job_id}/raw/{field}"
    whole = client.get(f"/jobs/{job_id}/raw/payload")
    assert whole.status_code == 200
    assert whole.headers["content-type"] == "application/json"
    disposition = whole.headers["content-disposition"]
    assert disposition == f'attachment; filename="job-{job_id}-payload.json"'
    assert whole.json() == {"blob": "x" * 300_000, "tail": SCRIPT}
    assert client.get(f"/jobs/{job_id}/raw/result").json()["tail"] == SCRIPT
    error_file = client.get(f"/jobs/{job_id}/raw/last_error")
    assert error_file.headers["content-type"] == "text/plain; charset=utf-8"
    assert error_file.headers["content-disposition"].endswith(f'job-{job_id}-last-error.txt"')
    assert error_file.text == f"MemoryError: {'x' * 300_000}\n{SCRIPT}"


def test_a_value_just_short_of_the_cut_is_shown_whole(
    client: TestClient, committed: Engine
) -> None:
    # '{"blob": "' + filler + '", "tail": "' + SCRIPT + '"}': exactly SHOWN characters.
    size = reads.SHOWN - len(json.dumps({"blob": "", "tail": SCRIPT}))
    job_id = big_job(committed, size)
    html = client.get(f"/jobs/{job_id}").text
    assert 'id="payload-cut"' not in html
    assert pre(html, "payload") == json.dumps({"blob": "x" * size, "tail": SCRIPT}, indent=2)
    assert 'id="result-cut"' not in html
    assert f'<a href="/jobs/{job_id}/raw/payload" id="payload-raw" download>' in html
    longer = client.get(f"/jobs/{big_job(committed, size + 1)}").text
    assert 'id="payload-cut"' in longer  # one character more
    assert len(pre(longer, "payload")) == reads.SHOWN


def test_downloading_a_value_that_is_not_there_is_a_404(
    client: TestClient, committed: Engine, jobs: dict[str, int]
) -> None:
    assert client.get(f"/jobs/{jobs['queued']}/raw/result").status_code == 404
    assert "has no result" in client.get(f"/jobs/{jobs['queued']}/raw/result").text
    assert "has no last error" in client.get(f"/jobs/{jobs['queued']}/raw/last_error").text
    assert client.get(f"/jobs/{jobs['queued']}/raw/payload").json() == {"report": 5}
    assert client.get(f"/jobs/{jobs['queued']}/raw/headers").status_code == 404
    assert client.get("/jobs/123456789/raw/payload").status_code == 404
    assert client.get("/jobs/abc/raw/payload").status_code == 400


def test_the_jobs_list_reads_no_payload_result_or_whole_error(
    client: TestClient, committed: Engine
) -> None:
    job_id = big_job(committed, 300_000)
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(committed, "before_cursor_execute", record)
    try:
        html = client.get("/jobs").text
    finally:
        event.remove(committed, "before_cursor_execute", record)
    (listing,) = [s for s in seen if "FROM sqlaq_jobs" in s and "ORDER BY sqlaq_jobs.id" in s]
    assert "payload" not in listing
    assert "result" not in listing
    assert "left(sqlaq_jobs.last_error, " in listing
    assert listing.count("last_error") == 1
    assert len(html) < 20_000
    assert "MemoryError: " + "x" * 60 in html  # the first line, cut for the table
    assert f'href="/jobs/{job_id}"' in html


@pytest.mark.parametrize("job_id", ["abc", "0", "-1", "99999999999999999999", "1.5"])
def test_a_bad_job_id_is_a_400(client: TestClient, job_id: str) -> None:
    response = client.get(f"/jobs/{job_id}")
    assert response.status_code == 400
    assert "job id" in response.text


def test_an_unknown_job_is_a_404(client: TestClient, committed: Engine) -> None:
    response = client.get("/jobs/123456789")
    assert response.status_code == 404
    assert "no job 123456789" in response.text


# -- actions -------------------------------------------------------------------------


def test_retry_and_cancel_buttons_change_the_job(
    client: TestClient, committed: Engine, jobs: dict[str, int]
) -> None:
    form = {csrf.FIELD: token(client)}
    response = client.post(f"/jobs/{jobs['failed']}/retry", data=form, follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"] == f"/jobs/{jobs['failed']}?did=retried"
    assert status_of(committed, jobs["failed"]) == "queued"
    assert "Job queued again." in client.get(response.headers["location"]).text

    response = client.post(f"/jobs/{jobs['running']}/cancel", data=form, follow_redirects=False)
    assert response.headers["location"].endswith("?did=cancelled")
    assert status_of(committed, jobs["running"]) == "cancelled"

    response = client.post(f"/jobs/{jobs['done']}/retry", data=form, follow_redirects=False)
    assert response.headers["location"].endswith("?did=not-retried")
    assert status_of(committed, jobs["done"]) == "done"
    response = client.post(f"/jobs/{jobs['done']}/cancel", data=form, follow_redirects=False)
    assert response.headers["location"].endswith("?did=not-cancelled")


def test_unknown_actions_and_methods_are_refused(
    client: TestClient, committed: Engine, jobs: dict[str, int]
) -> None:
    form = {csrf.FIELD: token(client)}
    assert client.post(f"/jobs/{jobs['failed']}/delete", data=form).status_code == 404
    assert client.get(f"/jobs/{jobs['failed']}/retry").status_code == 405
    assert client.post("/jobs/abc/retry", data=form).status_code == 400
    assert status_of(committed, jobs["failed"]) == "failed"


@pytest.mark.parametrize(
    ("cookie", "field", "headers"),
    [
        (None, None, {}),  # neither
        ("real", None, {}),  # the cookie alone: what another site can make a browser send
        (None, "real", {}),
        ("real", "x" * 43, {}),  # a mismatch
        ("real", "real", {"sec-fetch-site": "cross-site"}),
    ],
)
def test_an_action_without_the_csrf_token_is_refused(
    committed: Engine,
    jobs: dict[str, int],
    cookie: str | None,
    field: str | None,
    headers: dict[str, str],
) -> None:
    with TestClient(dashboard_app(committed), base_url=LOCAL) as client:
        real = token(client)
        client.cookies.clear()
        if cookie:
            client.cookies.set(csrf.COOKIE, real)
        data = {csrf.FIELD: real if field == "real" else field} if field else {}
        response = client.post(f"/jobs/{jobs['failed']}/retry", data=data, headers=headers)
        assert response.status_code == 403
        assert "CSRF" in response.text or "cross-site" in response.text
        bulk = {"kind": "send_email", "error": ERROR.splitlines()[0], "confirm": "yes", **data}
        assert client.post("/failures/retry", data=bulk, headers=headers).status_code == 403
    assert status_of(committed, jobs["failed"]) == "failed"


def test_pages_set_a_strict_http_only_csrf_cookie(client: TestClient, jobs: dict[str, int]) -> None:
    response = client.get(f"/jobs/{jobs['failed']}")
    cookie = response.headers["set-cookie"]
    assert cookie.startswith(f"{csrf.COOKIE}=")
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie
    assert "Path=/" in cookie
    value = client.cookies[csrf.COOKIE]
    assert f'name="{csrf.FIELD}" value="{value}"' in response.text
    # The browser keeps its token: the next page sets none and uses the same.
    again = client.get(f"/jobs/{jobs['failed']}")
    assert "set-cookie" not in again.headers
    assert f'value="{value}"' in again.text


def test_security_headers(client: TestClient, committed: Engine) -> None:
    response = client.get("/")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["x-content-type-options"] == "nosniff"


# -- failures ------------------------------------------------------------------------


def fail_jobs(engine: Engine, kind: str, errors: list[str]) -> list[int]:
    with engine.begin() as conn:
        ids = [r.job_id for r in sqlaq.enqueue_many(conn, [sqlaq.NewJob(kind)] * len(errors))]
        claimed = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=len(errors))
        for job, error in zip(sorted(claimed, key=lambda j: j.id), errors, strict=True):
            sqlaq.fail(conn, job.lease, error)
    return ids


def test_failures_are_grouped_by_kind_and_first_error_line(
    client: TestClient, committed: Engine
) -> None:
    fail_jobs(committed, "sync", ["IOError: down\n  File a", "IOError: down\n  File b", SCRIPT])
    fail_jobs(committed, "mail", ["IOError: down"])
    html = client.get("/failures").text
    rows = re.findall(
        r'<td class="num bad">(\d+)</td>\s*<td><a[^>]*>(\w+)</a></td>\s*<td class="error-line">'
        r"<a[^>]*>([^<]*)</a>",
        html,
    )
    assert rows == [
        ("2", "sync", "IOError: down"),
        ("1", "mail", "IOError: down"),
        ("1", "sync", "&lt;script&gt;alert(&#39;sqlaq&#39;)&lt;/script&gt;"),
    ]
    assert SCRIPT not in html
    assert html.count("Retry all") == 3
    assert client.get("/failures", params={"since": "all"}).status_code == 200
    with committed.begin() as conn:
        conn.execute(text("UPDATE sqlaq_jobs SET finished_at = now() - interval '2 days'"))
    assert "no failed job in this range" in client.get("/failures", params={"since": "1h"}).text
    assert client.get("/failures", params={"since": "never"}).status_code == 400


def test_retry_all_of_a_group_asks_first_then_retries_that_group_only(
    client: TestClient, committed: Engine
) -> None:
    group = fail_jobs(committed, "sync", ["IOError: down\n  a"] * 3)
    others = fail_jobs(committed, "sync", ["KeyError: x"]) + fail_jobs(
        committed, "mail", ["IOError: down"]
    )
    params = {"kind": "sync", "error": "IOError: down", "since": "7d"}
    confirm = client.get("/failures/retry", params=params)
    assert confirm.status_code == 200
    assert "Queue again <strong>3</strong> failed job(s)" in confirm.text
    assert 'name="confirm" value="yes"' in confirm.text
    form = {**params, csrf.FIELD: client.cookies[csrf.COOKIE]}
    refused = client.post("/failures/retry", data=form)  # no confirm=yes
    assert refused.status_code == 400
    assert "confirm" in refused.text
    assert {status_of(committed, i) for i in group} == {"failed"}

    done = client.post("/failures/retry", data={**form, "confirm": "yes"})
    assert done.status_code == 200
    assert "Retried 3 of 3 job(s)." in done.text
    assert {status_of(committed, i) for i in group} == {"queued"}
    assert {status_of(committed, i) for i in others} == {"failed"}
    gone = client.get("/failures/retry", params=params).text
    assert "No failed job matches this group any more." in gone


@pytest.mark.parametrize(
    "params",
    [{}, {"kind": "sync"}, {"error": "x"}, {"kind": "sync", "error": "x", "since": "soon"}],
)
def test_a_bad_failure_group_is_a_400(client: TestClient, params: dict[str, str]) -> None:
    assert client.get("/failures/retry", params=params).status_code == 400


# -- delete finished -----------------------------------------------------------------


def test_delete_finished_counts_first_then_deletes_old_finished_jobs(
    client: TestClient, committed: Engine, jobs: dict[str, int]
) -> None:
    with committed.begin() as conn:
        finish_long_ago(conn, jobs["done"], "done", "8 days")
        finish_long_ago(conn, jobs["failed"], "failed", "8 days")  # kept: failed keep 30d
    page = client.get("/prune")
    assert page.status_code == 200
    assert 'id="confirm-prune">Delete 1 job(s)' in page.text
    form = {"done": "7d", "cancelled": "7d", "failed": "30d", csrf.FIELD: token(client)}
    assert client.post("/prune", data=form).status_code == 400  # no confirm
    done = client.post("/prune", data={**form, "confirm": "yes"})
    assert "Deleted 1 of 1 job(s)." in done.text
    with committed.connect() as conn:
        left = {r.id for r in conn.execute(queries.find_jobs_stmt())}
    assert left == set(jobs.values()) - {jobs["done"]}
    keep = client.get("/prune", params={"done": "keep", "failed": "1d"}).text
    assert 'id="confirm-prune">Delete 1 job(s)' in keep  # the failed one, 8 days old
    assert client.get("/prune", params={"done": "a week"}).status_code == 400


# -- read-only -----------------------------------------------------------------------


def test_read_only_hides_and_refuses_every_action(committed: Engine, jobs: dict[str, int]) -> None:
    fail_jobs(committed, "sync", ["IOError: down"])
    with TestClient(dashboard_app(committed, read_only=True), base_url=LOCAL) as client:
        page = client.get(f"/jobs/{jobs['failed']}").text
        assert "read-only" in page
        assert "<form" not in page
        assert "Retry all" not in client.get("/failures").text
        assert (
            'name="confirm"'
            not in client.get(
                "/failures/retry", params={"kind": "sync", "error": "IOError: down"}
            ).text
        )
        assert "confirm-prune" not in client.get("/prune", params={"done": "0s"}).text
        form = {csrf.FIELD: client.cookies[csrf.COOKIE], "confirm": "yes"}
        for path, data in (
            (f"/jobs/{jobs['failed']}/retry", {}),
            (f"/jobs/{jobs['queued']}/cancel", {}),
            ("/failures/retry", {"kind": "sync", "error": "IOError: down"}),
            ("/prune", {"done": "0s"}),
        ):
            response = client.post(path, data={**form, **data})
            assert response.status_code == 403, path
            assert "read-only" in response.text
    assert status_of(committed, jobs["failed"]) == "failed"
    assert status_of(committed, jobs["queued"]) == "queued"
    assert status_of(committed, jobs["done"]) == "done"


# -- workers, limits and schedules ---------------------------------------------------


def test_workers_page_shows_concurrency_and_rates_in_use(
    committed: Engine, jobs: dict[str, int]
) -> None:
    registry = sqlaq.Registry()
    registry.add("resize_image", lambda payload: None, concurrency=3)
    registry.add("geocode", lambda payload: None, rate="5/m")
    with committed.begin() as conn:
        sqlaq.enqueue(conn, "geocode", {}, queue="geo")
    with committed.begin() as conn:
        claim = sqlaq.claim_limited(
            conn,
            worker_id=uuid.uuid4(),
            kind="geocode",
            queue="geo",
            limit=1,
            rate=sqlaq.Rate.parse("5/m"),
        )
        assert len(claim.jobs) == 1
    with TestClient(dashboard_app(committed, registry=registry), base_url=LOCAL) as client:
        html = client.get("/workers").text
    kinds = re.findall(
        r'<tr>\s*<td><a[^>]*>(\w+)</a></td>\s*<td class="num">(\d+)</td>\s*'
        r'<td class="num">([\d-]+)</td>',
        html,
    )
    assert kinds == [("geocode", "1", "-"), ("resize_image", "1", "3")]
    assert re.search(r"<td>geocode</td><td>5/60s</td><td class=\"num\">1</td>", html), html
    assert html.count("<code>") >= 2  # the workers holding the two running jobs
    with TestClient(dashboard_app(committed), base_url=LOCAL) as client:
        bare = client.get("/workers").text
    assert "pass it to <code>sqlaq.dashboard.app(engine, registry=...)</code>" in bare


def test_workers_page_lists_the_busiest_keys(committed: Engine) -> None:
    with committed.begin() as conn:
        sqlaq.enqueue_many(conn, [sqlaq.NewJob("k", key="acme") for _ in range(30)])
        sqlaq.enqueue_many(conn, [sqlaq.NewJob("k", key="<b>globex</b>") for _ in range(2)])
        sqlaq.enqueue(conn, "k", key="initech")
        sqlaq.enqueue(conn, "k")
    with committed.begin() as conn:
        claimed = sqlaq.claim(conn, worker_id=uuid.uuid4(), where=sqlaq.jobs.c.key == "initech")
        assert len(claimed) == 1
    with TestClient(dashboard_app(committed), base_url=LOCAL) as client:
        html = client.get("/workers").text
    table = html.split('id="keys"')[1].split("</table>")[0]
    rows = re.findall(
        r'<tr><td>([^<]*)</td><td class="num">(\d+)</td><td class="num">(\d+)</td>', table
    )
    # Most running first, then most queued; a key is text, escaped.
    assert rows == [
        ("initech", "1", "0"),
        ("acme", "0", "30"),
        ("&lt;b&gt;globex&lt;/b&gt;", "0", "2"),
    ]


def test_schedules_page_shows_last_slot_and_next_with_a_registry(committed: Engine) -> None:
    registry = sqlaq.Registry()
    registry.add("report", lambda payload: None)
    registry.add_periodic("0 * * * *", kind="report", name="hourly")
    registry.add_periodic("0 9 * * *", kind="report", name="morning", tz="Europe/Paris")
    first = datetime(2026, 1, 5, 8, 30, tzinfo=UTC)
    with committed.begin() as conn:
        sqlaq.enqueue_periodic(conn, registry.periodics, now=first)  # records the slot
    with TestClient(dashboard_app(committed), base_url=LOCAL) as client:
        html = client.get("/schedules").text
    assert "<td>hourly</td>" in html
    assert "2026-01-05 08:00:00" in html
    with TestClient(dashboard_app(committed, registry=registry), base_url=LOCAL) as client:
        html = client.get("/schedules").text
    assert "<code>0 * * * *</code></td><td>UTC</td>" in html
    assert "<code>0 9 * * *</code></td><td>Europe/Paris</td>" in html
    row = re.search(r"<td>hourly</td>.*?</tr>", html, re.S)
    assert row
    next_slot = re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", row.group(0))[-1]
    now = datetime.now(UTC)
    assert next_slot.endswith(":00:00")
    assert now < datetime.fromisoformat(next_slot + "+00:00") <= now + timedelta(hours=1)


# -- the schema, the mount point, the engine -----------------------------------------


def test_a_database_without_the_schema_gets_one_page_saying_what_to_run(
    empty_database_url: str,
) -> None:
    engine = create_engine(empty_database_url)
    try:
        with TestClient(dashboard_app(engine), base_url=LOCAL) as client:
            for path in ("/", "/jobs", "/jobs/1", "/failures", "/workers", "/schedules", "/prune"):
                response = client.get(path)
                assert response.status_code == 503, path
                assert "sqlaq&#39;s schema is not installed" in response.text
                assert "sqlaq migrate" in response.text
                assert "alembic upgrade heads" in response.text
                assert "Traceback" not in response.text
            api = client.get("/api/overview")
            assert api.status_code == 503
            assert "not installed" in api.json()["error"]
            form = {csrf.FIELD: client.cookies[csrf.COOKIE]}
            assert client.post("/jobs/1/retry", data=form).status_code == 503
    finally:
        engine.dispose()


def test_a_schema_behind_this_sqlaq_is_named_with_the_command(empty_database_url: str) -> None:
    engine = create_engine(empty_database_url)
    try:
        with engine.begin() as conn:
            sqlaq.migrations.upgrade(conn, "sqlaq_0001")
        with TestClient(dashboard_app(engine), base_url=LOCAL) as client:
            response = client.get("/")
        assert response.status_code == 503
        assert f"this sqlaq needs {sqlaq.migrations.HEAD}" in response.text
        assert "Traceback" not in response.text
    finally:
        engine.dispose()


def test_mounted_in_a_host_app_every_link_stays_under_its_path(
    committed: Engine, jobs: dict[str, int]
) -> None:
    host = Starlette(routes=[Mount("/queue", app=dashboard_app(committed))])
    with TestClient(host, base_url=LOCAL) as client:
        page = client.get("/queue/")
        assert page.status_code == 200
        links = re.findall(r'(?:href|src|action|data-api)="(/[^"]*)"', page.text)
        assert links
        assert all(link.startswith("/queue/") for link in links), links
        assert "Path=/queue" in page.headers["set-cookie"]
        assert client.get("/queue/static/uPlot.iife.min.js").status_code == 200
        form = {csrf.FIELD: client.cookies[csrf.COOKIE]}
        moved = client.post(
            f"/queue/jobs/{jobs['failed']}/retry", data=form, follow_redirects=False
        )
        assert moved.headers["location"] == f"/queue/jobs/{jobs['failed']}?did=retried"
        assert client.get("/queue/nothing").status_code == 404
    assert status_of(committed, jobs["failed"]) == "queued"


def test_an_async_engine_is_accepted(database_url: str, committed: Engine) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    async_engine = create_async_engine(
        database_url.replace("postgresql+psycopg://", "postgresql+psycopg_async://")
    )
    application = dashboard_app(async_engine)
    with TestClient(
        application, base_url=LOCAL
    ) as client:  # its lifespan disposes the engine it opened
        assert client.get("/").status_code == 200
    await_dispose = async_engine.dispose()
    import asyncio

    asyncio.run(await_dispose)


# -- the overview's queries: indexed, bounded ----------------------------------------


def test_the_overview_queries_read_the_finished_index_not_the_table(committed: Engine) -> None:
    with committed.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO sqlaq_jobs (kind, status, attempts, created_at, attempted_at,"
                " finished_at) SELECT 'old', 'done', 1, t, t, t FROM (SELECT now() -"
                " interval '7 days' * n / 50000.0 AS t FROM generate_series(1, 50000) n) s"
            )
        )
    with committed.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE sqlaq_jobs"))
    window, bucket = timedelta(hours=3), timedelta(minutes=1)
    statements = {
        "counts": queries.overview_counts_stmt(window=window),
        "health": queries.overview_health_stmt(),
        "throughput": queries.throughput_stmt(window=window, bucket=bucket),
        "wait": queries.wait_percentiles_stmt(window=window, bucket=bucket),
    }
    with committed.connect() as conn:
        for name, stmt in statements.items():
            compiled = stmt.compile(dialect=committed.dialect)
            plan = conn.exec_driver_sql(
                f"EXPLAIN (FORMAT JSON) {compiled}", compiled.params
            ).scalar_one()
            shown = json.dumps(plan)
            assert "sqlaq_jobs_finished_idx" in shown, (name, shown)
            assert '"Seq Scan"' not in shown, (name, shown)


# -- the command ---------------------------------------------------------------------


def test_the_dashboard_subcommand_parses_its_flags() -> None:
    args = admin.build_parser().parse_args(["dashboard"])
    assert (args.host, args.port, args.read_only) == ("127.0.0.1", 8000, False)
    args = admin.build_parser().parse_args(
        ["dashboard", "--host", "0.0.0.0", "--port", "9000", "--read-only"]  # noqa: S104
    )
    assert (args.host, args.port, args.read_only) == ("0.0.0.0", 9000, True)  # noqa: S104
    for bad in (["--port", "70000"], ["--port", "http"]):
        with pytest.raises(admin.UsageError, match="--port"):
            admin.build_parser().parse_args(["dashboard", *bad])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_sqlaq_dashboard_serves_until_sigterm(database_url: str, committed: Engine) -> None:
    import httpx

    port = free_port()
    command = [sys.executable, "-c", "from sqlaq.admin import main; main()"]
    proc = subprocess.Popen(
        [*command, "dashboard", "--database-url", database_url, "--port", str(port), "--read-only"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # uvicorn says when it listens
            lines.append(line)
            if "Uvicorn running on" in line:
                break
        assert any(f"http://127.0.0.1:{port}" in line for line in lines), lines
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
        assert page.status_code == 200
        assert "read-only" in page.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# -- paused queues and the workers' heartbeats ---------------------------------------


@pytest.fixture
def controls(committed: Engine) -> Iterator[Engine]:
    """No paused queue and no heartbeat row before and after the test (the ``committed``
    fixture empties the jobs' tables only)."""
    empty = text("TRUNCATE sqlaq_paused_queues, sqlaq_workers")
    with committed.begin() as conn:
        conn.execute(empty)
    try:
        yield committed
    finally:
        with committed.begin() as conn:
            conn.execute(empty)


def test_pause_and_resume_a_queue_from_the_overview(
    client: TestClient, controls: Engine, committed: Engine, jobs: dict[str, int]
) -> None:
    form = {csrf.FIELD: token(client), "queue": "reports"}
    response = client.post("/queues/pause", data=form, follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"] == "/?did=paused"
    with committed.connect() as conn:
        (paused,) = sqlaq.control.paused_queues(conn)
    assert paused.queue == "reports"
    assert paused.paused_by == "dashboard@testclient"
    page = client.get(response.headers["location"]).text
    assert "Queue paused" in page
    row = re.search(r"<td><a[^>]*>reports</a></td>.*?</tr>", page, re.S)
    assert row
    assert ">paused</span>" in row.group(0)
    assert ">Resume</button>" in row.group(0)
    # A paused queue with no job at all is listed too, so that it can be resumed.
    empty = {**form, "queue": "empty"}
    client.post("/queues/pause", data=empty)
    assert re.search(r"<td><a[^>]*>empty</a></td>", client.get("/").text)
    assert (
        client.post("/queues/pause", data=form, follow_redirects=False)
        .headers["location"]
        .endswith("did=not-paused")
    )

    response = client.post("/queues/resume", data=form, follow_redirects=False)
    assert response.headers["location"] == "/?did=resumed"
    with committed.connect() as conn:
        assert [p.queue for p in sqlaq.control.paused_queues(conn)] == ["empty"]
    assert (
        client.post("/queues/resume", data=form, follow_redirects=False)
        .headers["location"]
        .endswith("did=not-resumed")
    )


@pytest.mark.parametrize(
    ("path", "data", "status"),
    [
        ("/queues/pause", {}, 400),  # no queue
        ("/queues/pause", {"queue": ""}, 400),
        ("/queues/pause", {"queue": "a\x00b"}, 400),
        ("/queues/stop", {"queue": "reports"}, 404),
    ],
)
def test_a_bad_queue_action_is_refused(
    client: TestClient,
    controls: Engine,
    committed: Engine,
    path: str,
    data: dict[str, str],
    status: int,
) -> None:
    response = client.post(path, data={csrf.FIELD: token(client), **data})
    assert response.status_code == status
    with committed.connect() as conn:
        assert sqlaq.control.paused_queues(conn) == []


def test_pausing_needs_the_csrf_token_and_is_refused_read_only(
    controls: Engine, committed: Engine, jobs: dict[str, int]
) -> None:
    with TestClient(dashboard_app(committed), base_url=LOCAL) as client:
        assert client.post("/queues/pause", data={"queue": "reports"}).status_code == 403
    with TestClient(dashboard_app(committed, read_only=True), base_url=LOCAL) as client:
        page = client.get("/").text
        assert ">Pause</button>" not in page
        form = {csrf.FIELD: client.cookies[csrf.COOKIE], "queue": "reports"}
        assert client.post("/queues/pause", data=form).status_code == 403
    with committed.connect() as conn:
        assert sqlaq.control.paused_queues(conn) == []


def test_the_live_tables_keep_their_buttons_and_token(
    client: TestClient, jobs: dict[str, int]
) -> None:
    value = token(client)
    tables = client.get("/api/overview").json()["tables"]
    assert f'name="{csrf.FIELD}" value="{value}"' in tables
    assert ">Pause</button>" in tables


def test_workers_page_lists_the_heartbeat_rows(
    client: TestClient, controls: Engine, committed: Engine
) -> None:
    worker_id = uuid.uuid4()
    with committed.begin() as conn:
        conn.execute(
            queries.heartbeat_stmt(
                worker_id=worker_id, hostname="web-1", pid=4242, queues=["default"], concurrency=8
            )
        )
    html = client.get("/workers").text
    row = re.search(rf"<code>{worker_id}</code>.*?</tr>", html, re.S)
    assert row
    assert "<td>web-1</td>" in row.group(0)
    assert '<td class="num">4242</td>' in row.group(0)
    assert '<td class="num">8</td>' in row.group(0)
