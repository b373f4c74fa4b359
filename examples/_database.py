"""Where the examples run: `SQLAQ_DATABASE_URL` (or `DATABASE_URL`) when it is set, else
sqlaq's embedded PostgreSQL (`pip install 'sqlaq[embedded]'`), else the database
`sqlaq_quickstart` on the local server (127.0.0.1:5432, user `postgres`), created if
missing. Shared by the scripts of this folder (run as `python3 examples/<name>.py`)."""

from __future__ import annotations

import os

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

LOCAL_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/sqlaq_quickstart"


def database_url() -> str:
    url = os.environ.get("SQLAQ_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if url:
        return url
    try:
        from sqlaq import embedded
    except ImportError:  # without the extra: the local server
        return local_database_url()
    return embedded.database_url(os.environ.get("SQLAQ_EMBEDDED_DIR"))


def local_database_url() -> str:
    admin = create_engine(
        make_url(LOCAL_URL).set(database="postgres"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        exists = conn.execute(
            text("SELECT 1 FROM pg_database WHERE datname = 'sqlaq_quickstart'")
        ).scalar()
        if not exists:
            conn.execute(text("CREATE DATABASE sqlaq_quickstart"))
    admin.dispose()
    return LOCAL_URL
