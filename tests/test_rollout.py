"""``make rollout`` in small: two supervised worker pods (``--processes 2
--max-tasks-per-child 15``), each replaced once (SIGTERM, then a new pod), while tasks allowed
one attempt each run; the figures the benchmark checks must hold. (A worker that skipped what
reached it while draining lost a task or more in every such run.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_rolling_restart_with_recycling_loses_no_task_and_runs_each_once(
    tmp_path: Path,
) -> None:
    """240 tasks with max_attempts=1 over two pods replaced one after the other, their
    processes recycled every 15 tasks: every task SUCCEEDED with one attempt and one side
    effect, no lease expired, each pod exited 0."""
    output = tmp_path / "rollout.json"
    argv = ["--tasks", "240", "--pods", "2", "--rounds", "1", "--task-seconds", "0.01"]
    argv += ["--recycle", "15"]
    proc = subprocess.run(
        [sys.executable, "benchmarks/rollout.py", *argv, "--modes", "supervised", "--json", output],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert output.exists(), proc.stdout + proc.stderr[-3000:]
    (figures,) = json.loads(output.read_text())
    assert figures["one_own_side_effect"] == figures["tasks"] == 240, figures
    assert figures["lease_expiries"] == figures["duplicate_side_effects"] == 0, figures
    assert figures["restarts"] == 2 and figures["exit_statuses"] == {"0": 4}, figures
    # On a loaded machine a new pod may come up after the last task: one restart must overlap.
    assert figures["restarts_during_run"] >= 1, figures
