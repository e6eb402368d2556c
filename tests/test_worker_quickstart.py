"""``make demo``: the quickstart example runs its mixed batch and exits 0."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"


def test_quickstart_runs_clean() -> None:
    """The demo prints its per-outcome summary, meets a dropped connection and exits 0 (the
    subprocess timeout only bounds a hang: its speed is not asserted here)."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=40, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "per outcome: CANCELLED 1, SUCCEEDED 11" in proc.stdout
    assert re.search(r"reconnects=[1-9]", proc.stdout)
    # The retried attempts are told apart from failed tasks, and the drop is announced as part
    # of the tour before the worker's warning about it.
    assert "worker, per attempt: succeeded=11 failed=2 (first attempts the server retried)" in (
        proc.stdout
    )
    announced = proc.stderr.find("demo: cutting the worker's connection on purpose")
    assert 0 <= announced < proc.stderr.find("connection to ws://"), proc.stderr
    assert proc.stdout.rstrip().endswith("OK")
