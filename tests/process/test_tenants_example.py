"""examples/tenants.py: run as a script on a database of its own, it drains a flood of
one tenant and a few jobs of others, fairly then plainly, prints each tenant's wait
percentiles and exits 0; the small tenants wait less with fairness on."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_the_tenants_example_drains_fairly_and_prints_wait_percentiles(
    empty_database_url: str,
) -> None:
    env = {
        **os.environ,
        "SQLAQ_DATABASE_URL": empty_database_url,
        "TENANTS_FLOOD": "2000",
        "TENANTS_PER_TENANT": "20",
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tenants.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    fair_part, plain_part = result.stdout.split("plain claiming:")
    assert "fair claiming: 2100 jobs drained" in fair_part
    assert plain_part.startswith(" 2100 jobs drained")
    line = re.compile(r"^  (\w+) +(\d+) jobs  wait p50 +([\d.]+) s  p99 +([\d.]+) s$", re.M)
    fair = {m[1]: (int(m[2]), float(m[3]), float(m[4])) for m in line.finditer(fair_part)}
    plain = {m[1]: (int(m[2]), float(m[3]), float(m[4])) for m in line.finditer(plain_part)}
    tenants = ["acme", "globex", "initech", "umbrella", "hooli", "stark"]
    assert sorted(fair) == sorted(plain) == sorted(tenants)
    assert fair["acme"][0] == 2000
    assert all(fair[t][0] == 20 for t in tenants[1:])
    # Fairly, a small tenant's last job starts before the flood's median one; plainly,
    # after the flood's last (enqueued behind it all): orders of events, not speeds.
    assert all(fair[t][2] < fair["acme"][1] for t in tenants[1:])
    assert all(plain[t][1] > plain["acme"][2] for t in tenants[1:])
