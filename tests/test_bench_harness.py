"""The benchmark harness itself: ``benchmarks/run.py --quick`` runs end to end and reports every
section with its baseline and target. Structure only: speed is the benchmark's business."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Figures that must carry a target from the issues, with a PASS/FAIL verdict.
TARGETED = (
    "renew p50, 1 thread vs raw round trip",
    "renewal lateness p99",
    "lease losses",
    "server CPU/task vs worker's",
    "waiting (flat)",
    "admin enqueue",
    "server RSS after",
)


@pytest.mark.slow
def test_quick_run_reports_every_section(tmp_path: Path) -> None:
    """A --quick run exits 0, prints one table and writes every section's figures as JSON."""
    output = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--output", str(output)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(output.read_text())
    assert results["mode"] == "quick"
    assert results["machine"]["cores"] >= 1
    for section in ("calls", "worker", "dispatch", "lateness", "idle", "server_cpu"):
        assert section in results, section
    for section in ("admin_enqueue", "server_memory", "processes"):
        assert section in results, section
    assert results["lateness"]["n"] > 0 and results["lateness"]["floor_n"] > 0
    assert results["dispatch"]["n"] > 0
    assert results["worker"]["tasks"] >= 1 and results["worker"]["cpu"] > 0
    names = [r["name"] for r in results["rows"]]
    for fragment in TARGETED:
        rows = [r for r in results["rows"] if fragment in r["name"]]
        assert rows, fragment
        for r in rows:
            assert r["target"] and isinstance(r["pass"], bool), r
    for r in results["rows"]:
        assert r["ours"] == r["ours"] and r["ours"] >= 0, r  # measured, not NaN
        assert set(r) >= {"name", "ours", "base", "ratio", "unit", "target", "pass"}
        if r["base"] == 0:
            # A baseline that measured zero (possible in a quick run on a loaded host) has no ratio.
            assert math.isnan(r["ratio"]), r
        elif not math.isnan(r["base"]):
            assert r["ratio"] == pytest.approx(r["ours"] / r["base"])
    # One table on stdout, every figure in it; no peer ran in quick mode.
    assert proc.stdout.count("figure") == 1
    for name in names:
        assert name in proc.stdout
    assert "peers" not in results
    assert "token" not in output.read_text().lower()
