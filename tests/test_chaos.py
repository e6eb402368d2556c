"""Chaos runs of a user's Worker (``orbit_sync.testing.chaos``): the seeded schedule, the checks
of the protocol's promises, the non-idempotent handlers they catch, the pytest fixture, the
``orbit-sync chaos`` command and the docs' example."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import attrs
import pytest
from _cli_process import clean_env, run_cli

from orbit_sync.client import Client
from orbit_sync.testing import chaos
from orbit_sync.worker import TaskContext, Worker

pytest_plugins = ["pytester"]

QUEUE = "c" * 32
DOC = Path(__file__).resolve().parent.parent / "docs" / "mock-server.md"
#: A small, fast mix: leases of 1 s, so a lease-expiry stall lasts 1.55 s.
QUICK = chaos.FaultRates(lease_expiry_every=10, cut_every=15, duplicate_every=12, lease=1.0)


def _worker(*, effect: bool = False, **options: Any) -> Worker:
    """A worker of one no-op handler (saying its effect happened when *effect*)."""
    worker = Worker(Client("ws://127.0.0.1:9", "unused"), queue_id=QUEUE, **options)

    @worker.handler("noop")
    def noop(ctx: TaskContext, payload: Any) -> Any:
        if effect:
            chaos.effect(ctx)
        return {"i": payload["i"]}

    return worker


def test_a_seed_draws_the_same_schedule_every_time_and_seeds_differ() -> None:
    """plan() is a function of its arguments: one seed, one schedule; another seed, another."""
    for name in chaos.PROFILES:
        rates = chaos.profile(name)
        assert chaos.plan(7, 500, rates) == chaos.plan(7, 500, rates), name
        assert chaos.plan(7, 500, rates) != chaos.plan(8, 500, rates), name
        assert len(chaos.plan(7, 500, rates)) >= 10, name
    # Each kind has its own stream: turning one knob off leaves the others where they were.
    rates = chaos.profile("default")
    without_cuts = chaos.plan(7, 500, attrs.evolve(rates, cut_every=None))
    assert without_cuts == tuple(f for f in chaos.plan(7, 500, rates) if f.kind != "cut")


def test_a_correct_worker_breaks_no_promise_under_the_default_profile() -> None:
    """100 no-op tasks under the default profile: every fault of the seed's schedule fires, in
    its order, every task succeeds, no violation is reported."""
    report = chaos.run(_worker(), seed=5, tasks=100)
    assert report.violations == (), report.summary()
    assert report.states == {"SUCCEEDED": 100}
    assert report.planned == chaos.plan(5, 100, chaos.profile("default"))
    # In their order; the last ones may not be reached before every task has ended.
    fired = tuple(f for _, f in report.fired)
    assert fired == report.planned[: len(fired)]
    assert len(fired) >= sum(1 for f in report.planned if f.after <= 90)
    kinds = {f.kind for f in report.planned}
    assert kinds >= {"cut", "delay", "lost_ack", "duplicate", "lease_expiry"}, kinds
    assert report.attempts > 100 and report.cuts >= 1 and report.reconnects >= 1
    assert "seed 5; replay: orbit_sync.testing.chaos.run(worker, seed=5, tasks=100, " in (
        report.summary()
    )


@pytest.mark.parametrize("seed", [1, 2])
def test_a_non_idempotent_handler_is_reported_with_its_replay_line(seed: int) -> None:
    """A handler whose effect repeats when a lost lease gives its task a second attempt is
    reported under the default profile, as the user's, with the seed and the replay call."""
    report = chaos.run(_worker(effect=True), seed=seed, tasks=100)
    assert report.violations == (), report.summary()
    assert report.duplicate_effects, report.summary()
    for dup in report.duplicate_effects:
        assert len(dup.attempts) >= 2 and len({a for _, a in dup.attempts}) == len(dup.attempts)
        assert dup.faults, dup  # the faults fired between the two effects, or the last one
    with pytest.raises(AssertionError) as failed:
        report.check()
    text = str(failed.value)
    assert "YOUR HANDLER non-idempotent: task " in text
    assert f"seed {seed}; replay: orbit_sync.testing.chaos.run(worker, seed={seed}, " in text
    report.check(effects=False)  # not the worker's violation


def test_deploys_on_an_outbox_replace_the_worker_in_turn(tmp_path: Path) -> None:
    """The deploy fault stops the worker as SIGTERM does and starts a fresh one from the
    factory; with an outbox they take it in turn, on a temporary one, never the user's."""
    mine = tmp_path / "outbox.db"
    built: list[Worker] = []

    def factory() -> Worker:
        built.append(_worker(outbox=mine, drain_timeout=2.0))
        return built[-1]

    rates = chaos.FaultRates(restart_every=10, lease=1.0)
    report = chaos.run(factory, seed=3, tasks=40, rates=rates)
    assert report.ok, report.summary()
    assert report.states == {"SUCCEEDED": 40}
    restarts = sum(1 for _, f in report.fired if f.kind == "restart")
    assert restarts >= 2 and report.workers == restarts + 1 == len(built)
    assert not mine.exists(), "the user's outbox is never touched"
    assert "profile               custom" in report.summary()


def test_a_handler_running_on_past_its_lease_is_reported() -> None:
    """A first attempt that keeps running after its lease is gone (it undoes its cancellation)
    is reported twice: it ran past its lease uncancelled, and the next attempt overlapped it."""
    release = threading.Event()

    worker = _worker()

    @worker.handler("stubborn")
    def stubborn(ctx: TaskContext, payload: Any) -> Any:
        if ctx.attempt == 1:  # held past its lease as it begins
            # Ignore cancellation until the second attempt has begun (or 5 s went by).
            for _ in range(100):
                ctx.cancelled.clear()
                if release.wait(0.05):
                    break
            ctx.cancelled.clear()
        else:
            release.set()
        return {"attempt": ctx.attempt}

    rates = chaos.FaultRates(lease_expiry_every=0.4, lease=1.0)
    assert chaos.plan(0, 1, rates)[0] == chaos.PlannedFault(0, "lease_expiry", seconds=1.55)
    report = chaos.run(worker, seed=0, tasks=1, rates=rates, handler="stubborn")
    kinds = {v.kind for v in report.violations}
    assert {"ran past its lease", "overlapping attempts"} <= kinds, report.summary()
    past = next(v for v in report.violations if v.kind == "ran past its lease")
    assert past.attempt == 1 and past.faults and "lease_expiry" in past.faults[-1]


def test_tasks_left_unfinished_are_reported() -> None:
    """A run whose tasks cannot end within its time limit reports each task not terminal."""
    worker = _worker(drain_timeout=0.2, cancel_grace=0.2)

    @worker.handler("slow")
    def slow(ctx: TaskContext, payload: Any) -> Any:
        ctx.sleep(30)
        return None

    report = chaos.run(
        worker,
        tasks=2,
        rates=chaos.FaultRates(),
        handler="slow",
        time_limit=0.5,
        enqueue={"max_attempts": 1},
    )
    unfinished = [v for v in report.violations if v.kind == "not terminal"]
    assert len(unfinished) == 2, report.summary()
    assert {v.task_id for v in unfinished} == {s.task_id for s in report.snapshots}


def test_bad_arguments_are_refused_before_anything_runs() -> None:
    """Wrong seeds, counts, profiles, knobs, handlers and workers raise a clear error."""
    worker = _worker()
    with pytest.raises(ValueError, match="tasks must be an int >= 1"):
        chaos.run(worker, tasks=0)
    with pytest.raises(TypeError, match="seed must be an int"):
        chaos.run(worker, seed="7")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown chaos profile 'wifi'; expected one of"):
        chaos.run(worker, profile="wifi")
    with pytest.raises(TypeError, match="rates must be a FaultRates"):
        chaos.run(worker, rates={"cut_every": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the worker has no handler 'nope'"):
        chaos.run(worker, handler="nope")
    with pytest.raises(TypeError, match=r"worker must be an orbit_sync\.Worker"):
        chaos.run(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spacing"):
        chaos.FaultRates(cut_every=0)
    with pytest.raises(ValueError, match="lease must be between 1 and 120"):
        chaos.FaultRates(lease=0.5)


def test_the_command_reports_a_non_idempotent_handler_and_how_to_replay_it(
    tmp_path: Path,
) -> None:
    """orbit-sync chaos module:worker runs the module's Worker, prints progress and the table,
    exits 1 on a non-idempotent handler with the command that replays the seed; a wrong
    profile is a usage error."""
    (tmp_path / "app.py").write_text(
        "from orbit_sync import Worker\n"
        "from orbit_sync.client import Client\n"
        "from orbit_sync.testing import chaos\n"
        "worker = Worker(Client.from_env())\n"
        "@worker.handler('charge')\n"
        "def charge(ctx, payload):\n"
        "    chaos.effect(ctx)\n"
        "    return payload\n",
        encoding="utf-8",
    )
    argv = ("chaos", "app:worker", "--seed", "3", "--tasks", "30", "--lease-expiry-every", "10")
    done = run_cli(*argv, "--lease", "1", env=clean_env(), cwd=tmp_path, timeout=60)
    assert done.returncode == 1, done.stderr
    assert re.search(r"^non-idempotent tasks\s+[1-9]", done.stdout, re.M), done.stdout
    assert "YOUR HANDLER non-idempotent: task " in done.stdout
    replay = (
        "seed 3; replay: orbit-sync chaos app:worker --seed 3 --tasks 30 --profile default "
        "--lease-expiry-every 10 --lease 1"
    )
    assert replay in done.stdout
    assert "chaos: 30/30 tasks terminal" in done.stderr
    wrong = run_cli("chaos", "app:worker", "--profile", "wifi", env=clean_env(), cwd=tmp_path)
    assert wrong.returncode == 2 and "invalid choice: 'wifi'" in wrong.stderr


def _doc_example() -> str:
    text = DOC.read_text(encoding="utf-8")
    found = re.findall(r"^<!-- doc-test: chaos -->\n```python\n(.*?)^```$", text, re.M | re.S)
    assert len(found) == 1, "docs/mock-server.md has one chaos example marked doc-test: chaos"
    return str(found[0])


def test_the_documented_example_catches_its_non_idempotent_handler(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The docs' orbit_chaos example fails, naming the handler's repeated effect, the seed of
    $ORBIT_CHAOS_SEED and the command that replays it."""
    monkeypatch.setenv("ORBIT_CHAOS_SEED", "4")
    pytester.makepyfile(test_charge=_doc_example())
    result = pytester.runpytest_inprocess("-q", "-p", "no:randomly")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "YOUR HANDLER non-idempotent: task " in out
    assert (
        "seed 4; replay: ORBIT_CHAOS_SEED=4 python -m pytest "
        "test_charge.py::test_charge_under_chaos"
    ) in out
