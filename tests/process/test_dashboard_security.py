"""Who may reach the dashboard, over HTTP (Starlette's test client) against the real
database: the host names it answers (DNS rebinding), CSRF tokens only the dashboard
issued, ``Origin`` and ``Sec-Fetch-Site`` on every POST, the authentication hook and
HTTP Basic, and what ``sqlaq dashboard`` asks before it serves another machine."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from test_dashboard import ERROR, LOCAL, free_port, populate, status_of, token

import sqlaq.dashboard
from sqlaq import admin
from sqlaq.dashboard import app as dashboard_app
from sqlaq.dashboard import basic_auth, csrf
from sqlaq.dashboard.guard import BasicAuth, Guard
from sqlaq.errors import ConfigError

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from starlette.testclient import TestClient

#: A site whose name its owner made resolve to the dashboard's address.
ATTACKER = "http://attacker.example:8000"


@pytest.fixture
def jobs(committed: Engine) -> dict[str, int]:
    return populate(committed)


def client_for(application: Any, base_url: str = LOCAL, **kwargs: Any) -> TestClient:
    return TestClient(application, base_url=base_url, **kwargs)


def basic(user: str, password: str) -> dict[str, str]:
    encoded = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"authorization": f"Basic {encoded}"}


def ipv6_host_headers_parsed() -> bool:
    """Whether this Starlette's TrustedHostMiddleware reads ``[::1]:8000`` as the host
    ``[::1]`` (older ones cut it at the first colon, and refuse it: closed, not open)."""
    import starlette._utils

    return hasattr(starlette._utils, "parse_host_header")


# -- the host names it answers ---------------------------------------------------------


def test_a_foreign_host_gets_no_page_and_no_action(committed: Engine, jobs: dict[str, int]) -> None:
    application = dashboard_app(committed)
    with client_for(application) as local:
        real = token(local)  # a token the dashboard issued, as a rebound page would read
    with client_for(application, base_url=ATTACKER) as foreign:
        for path in (
            "/",
            "/jobs",
            f"/jobs/{jobs['failed']}",
            "/api/overview",
            "/static/dashboard.css",
        ):
            response = foreign.get(path)
            assert response.status_code == 400, path
            assert "Invalid host header" in response.text
            assert csrf.COOKIE not in response.headers.get("set-cookie", "")
        foreign.cookies.set(csrf.COOKIE, real)
        response = foreign.post(
            f"/jobs/{jobs['running']}/cancel",
            data={csrf.FIELD: real},
            headers={"origin": ATTACKER},
        )
        assert response.status_code == 400
    assert status_of(committed, jobs["running"]) == "running"


@pytest.mark.parametrize(
    "host",
    ["localhost", "localhost:8000", "127.0.0.1:8000", "LOCALHOST:1"],
)
def test_the_local_names_are_answered_by_default(committed: Engine, host: str) -> None:
    with client_for(dashboard_app(committed), base_url=f"http://{host}") as client:
        assert client.get("/").status_code == 200


def test_an_ipv6_loopback_is_answered_where_starlette_parses_it(committed: Engine) -> None:
    with client_for(dashboard_app(committed), base_url="http://[::1]:8000") as client:
        try:
            status = client.get("/").status_code
        except ValueError:  # the floor's test client splits the Host at its first colon
            if ipv6_host_headers_parsed():
                raise
            pytest.skip("this Starlette's test client cannot send an IPv6 Host header")
    assert status == (200 if ipv6_host_headers_parsed() else 400)


@pytest.mark.parametrize(
    "host",
    ["localhost.attacker.example", "127.0.0.1.nip.io", "attacker.example", "10.0.0.5"],
)
def test_names_that_merely_look_local_are_refused(committed: Engine, host: str) -> None:
    with client_for(dashboard_app(committed), base_url=f"http://{host}:8000") as client:
        assert client.get("/").status_code == 400


def test_allowed_hosts_replace_the_local_names(committed: Engine) -> None:
    application = dashboard_app(committed, allowed_hosts=["queue.example.com", "*.ops.example"])
    for base, status in (
        ("https://queue.example.com", 200),
        ("https://a.ops.example", 200),
        ("https://ops.example.evil", 400),
        (LOCAL, 400),
    ):
        with client_for(application, base_url=base) as client:
            assert client.get("/").status_code == status, base
    anywhere = dashboard_app(committed, allowed_hosts=["*"])
    with client_for(anywhere, base_url=ATTACKER) as client:
        assert client.get("/").status_code == 200


@pytest.mark.parametrize(
    "hosts",
    [[], [""], ["localhost:8000"], ["http://queue.example.com"], ["a*.example.com"], ["*x.com"]],
)
def test_a_host_name_it_cannot_match_is_a_config_error(committed: Engine, hosts: list[str]) -> None:
    with pytest.raises(ConfigError, match="host"):
        dashboard_app(committed, allowed_hosts=hosts)


# -- CSRF: tokens it issued, from its own pages ------------------------------------------


@pytest.mark.parametrize(
    "forged",
    ["A" * 43, "x.y", "abc." + "B" * 43, "..", "%C3%A9.x"],
)
def test_a_csrf_cookie_the_dashboard_never_issued_is_refused(
    client_factory: Any, committed: Engine, jobs: dict[str, int], forged: str
) -> None:
    with client_factory() as client:
        client.cookies.set(csrf.COOKIE, forged)
        response = client.post(f"/jobs/{jobs['failed']}/retry", data={csrf.FIELD: forged})
        assert response.status_code == 403
        assert "CSRF" in response.text
        # A page replaces it with a token of its own.
        client.cookies.clear()
        client.cookies.set(csrf.COOKIE, forged)
        page = client.get("/")
        assert page.headers["set-cookie"].startswith(f"{csrf.COOKIE}=")
        issued = page.cookies[csrf.COOKIE]
        assert issued != forged
        assert f'name="{csrf.FIELD}" value="{issued}"' in page.text
    assert status_of(committed, jobs["failed"]) == "failed"


@pytest.fixture
def client_factory(committed: Engine) -> Any:
    return lambda **kwargs: client_for(dashboard_app(committed, **kwargs))


def test_tokens_are_good_for_the_dashboard_that_issued_them(
    committed: Engine, jobs: dict[str, int]
) -> None:
    with client_for(dashboard_app(committed)) as first:
        issued = token(first)
    # Another process (a random secret of its own) refuses it...
    with client_for(dashboard_app(committed)) as other:
        other.cookies.set(csrf.COOKIE, issued)
        refused = other.post(f"/jobs/{jobs['failed']}/retry", data={csrf.FIELD: issued})
        assert refused.status_code == 403
    # ... unless every process is given the same secret.
    secret = "a shared secret of enough bytes"  # noqa: S105
    with client_for(dashboard_app(committed, csrf_secret=secret)) as one:
        shared = token(one)
    with client_for(dashboard_app(committed, csrf_secret=secret.encode())) as two:
        two.cookies.set(csrf.COOKIE, shared)
        moved = two.post(
            f"/jobs/{jobs['failed']}/retry", data={csrf.FIELD: shared}, follow_redirects=False
        )
        assert moved.status_code == 303
    assert status_of(committed, jobs["failed"]) == "queued"


def test_a_short_csrf_secret_is_a_config_error(committed: Engine) -> None:
    with pytest.raises(ConfigError, match="csrf_secret: at least 16 bytes"):
        dashboard_app(committed, csrf_secret="short")  # noqa: S106


def post_routes(jobs: dict[str, int]) -> list[tuple[str, dict[str, str]]]:
    """Every POST of the dashboard, with a form it would take."""
    group = {"kind": "send_email", "error": ERROR.splitlines()[0], "confirm": "yes"}
    return [
        (f"/jobs/{jobs['failed']}/retry", {}),
        (f"/jobs/{jobs['running']}/cancel", {}),
        ("/queues/pause", {"queue": "reports"}),
        ("/queues/resume", {"queue": "reports"}),
        ("/failures/retry", group),
        ("/prune", {"done": "0s", "confirm": "yes"}),
    ]


def test_every_post_route_is_listed(committed: Engine) -> None:
    application = dashboard_app(committed)
    posted = {
        route.path  # type: ignore[attr-defined]
        for route in application.routes
        if "POST" in (getattr(route, "methods", None) or ())
    }
    assert posted == {
        "/jobs/{job_id}/{verb:str}",
        "/queues/{verb:str}",
        "/failures/retry",
        "/prune",
    }


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "http://attacker.example"},
        {"origin": "http://localhost:3000"},  # another port of the same host
        {"origin": "null"},
        {"origin": "file://"},
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site"},
        {"origin": "http://localhost", "sec-fetch-site": "same-site"},
    ],
)
def test_every_post_from_another_site_is_refused(
    committed: Engine, jobs: dict[str, int], headers: dict[str, str]
) -> None:
    with client_for(dashboard_app(committed)) as client:
        form = {csrf.FIELD: token(client)}
        for path, data in post_routes(jobs):
            response = client.post(path, data={**form, **data}, headers=headers)
            assert response.status_code == 403, (path, response.text)
            assert "cross-site request refused" in response.text
    assert status_of(committed, jobs["failed"]) == "failed"
    assert status_of(committed, jobs["running"]) == "running"
    assert status_of(committed, jobs["done"]) == "done"


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "http://localhost", "sec-fetch-site": "same-origin"},
        {"origin": "http://localhost:80"},
        {"sec-fetch-site": "none"},  # typed by the user: no page sent it
        {},  # no browser at all
    ],
)
def test_a_post_from_the_dashboards_own_page_passes(
    committed: Engine, jobs: dict[str, int], headers: dict[str, str]
) -> None:
    with client_for(dashboard_app(committed)) as client:
        form = {csrf.FIELD: token(client)}
        response = client.post(
            f"/jobs/{jobs['failed']}/retry", data=form, headers=headers, follow_redirects=False
        )
        assert response.status_code == 303
    assert status_of(committed, jobs["failed"]) == "queued"


# -- authentication ---------------------------------------------------------------------


def test_basic_auth_asks_every_request_for_credentials(
    committed: Engine, jobs: dict[str, int]
) -> None:
    application = dashboard_app(committed, auth=basic_auth("ops", "s3cret pass"))
    with client_for(application) as client:
        for path in (
            "/",
            "/jobs",
            f"/jobs/{jobs['failed']}",
            "/api/overview",
            "/static/dashboard.css",
        ):
            response = client.get(path)
            assert response.status_code == 401, path
            assert response.headers["www-authenticate"].startswith('Basic realm="sqlaq dashboard"')
            assert "set-cookie" not in response.headers
        for wrong in (basic("ops", "s3cret"), basic("op", "s3cret pass"), basic("ops", "")):
            assert client.get("/", headers=wrong).status_code == 401
        for garbled in ("Basic !!!", "Basic " + base64.b64encode(b"no colon").decode(), "Bearer x"):
            assert client.get("/", headers={"authorization": garbled}).status_code == 401
        assert client.post(f"/jobs/{jobs['failed']}/retry", data={}).status_code == 401

        client.headers.update(basic("ops", "s3cret pass"))
        assert client.get("/").status_code == 200
        form = {csrf.FIELD: token(client)}
        moved = client.post(f"/jobs/{jobs['failed']}/retry", data=form, follow_redirects=False)
        assert moved.status_code == 303
    assert status_of(committed, jobs["failed"]) == "queued"


def test_a_foreign_host_is_refused_before_authentication(committed: Engine) -> None:
    application = dashboard_app(committed, auth=basic_auth("ops", "pw"))
    with client_for(application, base_url=ATTACKER) as client:
        assert client.get("/", headers=basic("ops", "pw")).status_code == 400


@pytest.mark.parametrize(("user", "password"), [("", "pw"), ("a:b", "pw"), ("ops", "")])
def test_basic_auth_needs_a_user_and_a_password(user: str, password: str) -> None:
    with pytest.raises(ConfigError):
        basic_auth(user, password)


def test_a_host_apps_own_auth_guards_the_mounted_dashboard(
    committed: Engine, jobs: dict[str, int]
) -> None:
    seen: list[str] = []

    async def host_login(request: Request) -> Response | None:
        seen.append(request.url.path)
        if request.cookies.get("session") == "admin":
            return None
        return RedirectResponse("/login", status_code=303)

    dashboard = dashboard_app(committed, allowed_hosts=["queue.example.com"], auth=host_login)
    host = Starlette(routes=[Mount("/queue", app=dashboard)])
    with client_for(host, base_url="https://queue.example.com") as client:
        refused = client.get("/queue/jobs", follow_redirects=False)
        assert (refused.status_code, refused.headers["location"]) == (303, "/login")
        client.cookies.set("session", "admin")
        assert client.get("/queue/jobs").status_code == 200
        form = {csrf.FIELD: client.cookies[csrf.COOKIE]}
        moved = client.post(
            f"/queue/jobs/{jobs['failed']}/retry",
            data=form,
            headers={"origin": "https://queue.example.com"},
            follow_redirects=False,
        )
        assert moved.headers["location"] == f"/queue/jobs/{jobs['failed']}?did=retried"
    assert seen[:2] == ["/queue/jobs", "/queue/jobs"]
    assert status_of(committed, jobs["failed"]) == "queued"


def test_a_synchronous_hook_works_too(committed: Engine) -> None:
    def closed(request: Request) -> Response | None:
        return Response("closed for maintenance", status_code=503)

    with client_for(dashboard_app(committed, auth=closed)) as client:
        response = client.get("/")
    assert (response.status_code, response.text) == (503, "closed for maintenance")


# -- the command -----------------------------------------------------------------------


def run_dashboard(
    args: list[str], environ: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, dict[str, Any]]:
    """``sqlaq dashboard ARGS`` in this process, with the server replaced by a recorder
    of what it would serve (nothing listens; the database is never reached)."""
    served: dict[str, Any] = {}

    def record(engine: Engine, **kwargs: Any) -> None:
        served.update(kwargs)

    monkeypatch.setattr(sqlaq.dashboard, "serve", record)
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"
    code = admin.run(["dashboard", "--database-url", url, *args], environ)
    return code, served


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "queue.example.com"])  # noqa: S104
def test_a_non_local_host_without_a_password_is_refused(
    host: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, served = run_dashboard(["--host", host], {}, monkeypatch)
    assert code == 2
    assert served == {}
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"sqlaq: dashboard: --host {host} lets other machines connect")
    assert "SQLAQ_DASHBOARD_PASSWORD" in err
    assert "--insecure-no-auth" in err


def test_insecure_no_auth_serves_without_a_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, served = run_dashboard(["--host", "0.0.0.0", "--insecure-no-auth"], {}, monkeypatch)  # noqa: S104
    assert code == 0
    assert served["auth"] is None
    assert served["allowed_hosts"] == ["localhost", "127.0.0.1", "[::1]"]
    err = capsys.readouterr().err
    assert "without authentication (--insecure-no-auth)" in err
    assert "name the others with --allowed-host" in err


def test_a_password_from_the_environment_turns_basic_auth_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    environ = {"SQLAQ_DASHBOARD_PASSWORD": "pw from env", "SQLAQ_DASHBOARD_USER": "ops"}
    code, served = run_dashboard(["--host", "10.1.2.3"], environ, monkeypatch)
    assert code == 0
    auth = served["auth"]
    assert isinstance(auth, BasicAuth)
    # The bound address is a name the dashboard answers too.
    assert served["allowed_hosts"] == ["localhost", "127.0.0.1", "[::1]", "10.1.2.3"]
    assert "Basic auth sends the password in clear text" in capsys.readouterr().err
    with client_for(_probe(auth)) as client:
        assert client.get("/").status_code == 401
        assert client.get("/", headers=basic("ops", "pw from env")).status_code == 200
        assert client.get("/", headers=basic("sqlaq", "pw from env")).status_code == 401


def _probe(auth: Any) -> Starlette:
    """An app answering ``ok`` at ``/``, behind *auth* as the dashboard puts it."""

    async def ok(request: Request) -> Response:
        return Response("ok")

    return Starlette(routes=[Route("/", ok)], middleware=[Middleware(Guard, auth=auth)])


def test_a_password_file_and_allowed_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "password"
    secret.write_text("from the file\nsecond line ignored\n")
    environ = {"SQLAQ_DASHBOARD_PASSWORD": "loses to the file"}
    args = ["--host", "0.0.0.0", "--password-file", str(secret), "--user", "admin"]  # noqa: S104
    code, served = run_dashboard(
        [*args, "--allowed-host", "queue.example.com", "--allowed-host", "[fd00::1]"],
        environ,
        monkeypatch,
    )
    assert code == 0
    assert served["allowed_hosts"] == ["queue.example.com", "[fd00::1]"]
    with client_for(_probe(served["auth"])) as client:
        assert client.get("/", headers=basic("admin", "from the file")).status_code == 200
        assert client.get("/", headers=basic("admin", "loses to the file")).status_code == 401
    code, served = run_dashboard(
        [], {"SQLAQ_DASHBOARD_ALLOWED_HOSTS": "a.example, b.example c.example"}, monkeypatch
    )
    assert code == 0
    assert served["allowed_hosts"] == ["a.example", "b.example", "c.example"]
    assert served["auth"] is None  # local: no password needed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--password-file", "/nonexistent/pw"], "--password-file: cannot read /nonexistent/pw"),
        (["--password-file", "EMPTY"], "holds no password"),
        (["--allowed-host", "localhost:8000"], "allowed host 'localhost:8000'"),
        (["--user", "a:b", "--password-file", "GOOD"], "dashboard user"),
    ],
)
def test_bad_access_settings_are_one_line_errors(
    args: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "good").write_text("pw\n")
    args = [
        {"EMPTY": str(tmp_path / "empty"), "GOOD": str(tmp_path / "good")}.get(a, a) for a in args
    ]
    code, served = run_dashboard(args, {}, monkeypatch)
    assert (code, served) == (2, {})
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert message in err
    assert "Traceback" not in err


def test_sqlaq_dashboard_with_a_password_asks_for_it(database_url: str, committed: Engine) -> None:
    import httpx

    port = free_port()
    command = [sys.executable, "-c", "from sqlaq.admin import main; main()"]
    env = {**os.environ, "SQLAQ_DASHBOARD_PASSWORD": "pw"}
    proc = subprocess.Popen(
        [*command, "dashboard", "--database-url", database_url, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # uvicorn says when it listens
            if "Uvicorn running on" in line:
                break
        base = f"http://127.0.0.1:{port}/"
        assert httpx.get(base, timeout=10).status_code == 401
        assert httpx.get(base, auth=("sqlaq", "pw"), timeout=10).status_code == 200
        rebound = httpx.get(
            base, auth=("sqlaq", "pw"), headers={"host": f"attacker.example:{port}"}, timeout=10
        )
        assert rebound.status_code == 400
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
