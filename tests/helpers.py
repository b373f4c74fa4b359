"""Small helpers shared by the tests (SQL for assertions and set-up only)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, text


def job_row(conn: Connection, job_id: int) -> Any:
    """The job's row, every column, as a named tuple."""
    return conn.execute(text("SELECT * FROM sqlaq_jobs WHERE id = :id"), {"id": job_id}).one()


def count_jobs(conn: Connection, where: str = "true", **params: Any) -> int:
    return conn.execute(text(f"SELECT count(*) FROM sqlaq_jobs WHERE {where}"), params).scalar_one()


def expire_lease(conn: Connection, job_id: int) -> None:
    """Back-date a running job's lease instead of sleeping until it ends."""
    conn.execute(
        text("UPDATE sqlaq_jobs SET run_at = now() - interval '1 second' WHERE id = :id"),
        {"id": job_id},
    )


def finish_long_ago(conn: Connection, job_id: int, status: str, age: str) -> None:
    conn.execute(
        text(
            "UPDATE sqlaq_jobs SET status = :status, finished_at = now() - CAST(:age AS interval)"
            " WHERE id = :id"
        ),
        {"id": job_id, "status": status, "age": age},
    )
