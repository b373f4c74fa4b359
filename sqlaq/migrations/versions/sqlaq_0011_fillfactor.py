"""the jobs table leaves half of each page free for the updates of its rows

Revision ID: sqlaq_0011
Revises: sqlaq_0010
Create Date: 2026-12-07

Frozen literal DDL, like the revisions before it. No table rewrite: a storage parameter,
``fillfactor = 50``, which only new pages follow (rows inserted from now on fill half of
a page); the pages already written stay as they are until a ``VACUUM FULL`` or
``CLUSTER`` of the host's choosing. ``ALTER TABLE ... SET`` of a fillfactor takes a
``SHARE UPDATE EXCLUSIVE`` lock: enqueues, claims and reads go on meanwhile.

Each job's row is written three times: inserted, then updated by its claim and by its
outcome. Neither update can be a heap-only one (both change indexed columns), but each
can put the row's new version on the same page, if the page has room: one page dirtied
and logged instead of two, and no search for a page with room. At the default
fillfactor (100) a page of new jobs is full, so every claim moved its row to another
page. Half a page free holds the claim's new version; the outcome's finds the room the
page's pruning freed from the row's first version. Measured (``bench/RESULTS.md``, "A
sixteenth machine"): a drain's WAL a job 953 bytes -> 758, the table after the drain of
50,000 jobs 2,705 pages -> 2,115; the queued rows before it take twice the pages (810 ->
1,646).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from sqlaq.migrations import _citus

revision: str = "sqlaq_0011"
down_revision: str | None = "sqlaq_0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _citus.prepare()
    op.execute("ALTER TABLE sqlaq_jobs SET (fillfactor = 50)")
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0011'::text $$"
    )


def downgrade() -> None:
    _citus.prepare()
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0010'::text $$"
    )
    op.execute("ALTER TABLE sqlaq_jobs RESET (fillfactor)")
