"""freezegun's frozen time drives the mock server and the worker through
``ManualClock(follow=...)``; orbit-sync's own network bounds stay in real time under it;
wall-clock ages follow it."""

from __future__ import annotations

import datetime as dt
import re
import threading
import time
from pathlib import Path

import pytest
from _scripted import WAIT, registration
from freezegun import freeze_time

from orbit_sync import CapacityReport, Client
from orbit_sync.contrib.health import HealthProbe, check_heartbeat
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.worker.runtime._link import Wakeup

pytest_plugins = ["pytester"]

DOC = Path(__file__).resolve().parent.parent / "docs" / "mock-server.md"
_BLOCK = re.compile(r"^<!-- doc-test: pytest -->\n```python\n(?P<code>.*?)^```$", re.M | re.S)


def _doc_blocks() -> list[str]:
    return [m.group("code") for m in _BLOCK.finditer(DOC.read_text(encoding="utf-8"))]


def test_the_page_has_a_freezegun_example_by_hand_and_one_with_the_fixtures() -> None:
    """docs/mock-server.md shows freezegun with a MockOrbitServer built by hand, then with the
    pytest fixtures (an orbit_clock that follows frozen time, and orbit_worker on it)."""
    blocks = _doc_blocks()
    assert len(blocks) == 2, "the page has two freezegun examples marked <!-- doc-test: pytest -->"
    by_hand, fixtures = blocks
    assert "MockOrbitServer(clock=clock" in by_hand
    # The fixture's worker is given no clock: it takes the server's.
    assert "def orbit_clock(frozen)" in fixtures and "orbit_worker(listeners=[" in fixtures


@pytest.mark.parametrize("index", [0, 1], ids=["by-hand", "fixtures"])
def test_the_documented_freezegun_example_passes(index: int, pytester: pytest.Pytester) -> None:
    """Each of docs/mock-server.md's freezegun examples runs as a test file and its tests pass."""
    code = _doc_blocks()[index]
    pytester.makepyfile(test_freezegun_example=code)
    result = pytester.runpytest_inprocess("-q", "-p", "no:randomly")
    result.assert_outcomes(passed=code.count("\ndef test_"))


def test_a_tick_of_frozen_time_ends_a_timed_wait_on_the_following_clock() -> None:
    """A wait of 30 s on the clock sleeps through a 10 s tick and ends at the next 20 s one."""
    with freeze_time("2026-03-01 12:00:00") as frozen:
        clock = ManualClock(follow=frozen)
        wake = Wakeup(clock)
        result: list[bool] = []
        thread = threading.Thread(target=lambda: result.append(wake.wait(30.0)), daemon=True)
        thread.start()
        assert clock.wait_for_sleepers(1)
        frozen.tick(10)
        assert clock.wait_for_sleepers(1), "10 of 30 seconds must not end the wait"
        assert not result
        frozen.tick(dt.timedelta(seconds=20))
        thread.join(WAIT)
        assert result == [False]


def test_the_following_clock_reads_the_frozen_time() -> None:
    """now() starts at the frozen instant and equals time.time() after tick() and move_to()."""
    with freeze_time("2026-03-01 12:00:00.250000") as frozen:
        clock = ManualClock(follow=frozen)
        assert (
            clock.now()
            == time.time()
            == dt.datetime(2026, 3, 1, 12, 0, 0, 250000, tzinfo=dt.timezone.utc).timestamp()
        )
        frozen.tick(1.5)
        assert clock.now() == time.time()
        frozen.move_to("2026-03-01 13:00:00")
        assert clock.now() == time.time() == 1772370000.0


def test_frozen_time_may_not_move_back_under_a_following_clock() -> None:
    """Moving frozen time back raises ValueError and puts it back: the clock never goes back."""
    with freeze_time("2026-03-01 12:00:00") as frozen:
        clock = ManualClock(follow=frozen)
        frozen.tick(60)
        with pytest.raises(ValueError, match="cannot move back"):
            frozen.move_to("2026-03-01 12:00:30")
        with pytest.raises(ValueError, match="cannot move back"):
            frozen.tick(-1)
        assert clock.now() == time.time() == 1772366460.0


def test_follow_refuses_time_that_moves_by_itself_and_a_start() -> None:
    """A ticking frozen time, something else than freezegun's, or start with follow: TypeError."""
    with freeze_time("2026-03-01", tick=True) as ticking, pytest.raises(TypeError, match="tick"):
        ManualClock(follow=ticking)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="freeze_time"):
        ManualClock(follow=ManualClock())  # type: ignore[arg-type]
    with freeze_time("2026-03-01") as frozen, pytest.raises(TypeError, match="not both"):
        ManualClock(0.0, follow=frozen)


def test_server_time_on_the_wire_is_the_frozen_time() -> None:
    """The welcome's server_time is the frozen instant; a tick moves the next one with it."""
    with freeze_time("2026-03-01 12:00:00") as frozen:
        clock = ManualClock(follow=frozen)
        with MockOrbitServer(clock=clock, assignment_rate=None) as server:
            reg = registration(queue_id=server.queue_id)
            with Client(server.url, server.token).dial_worker(reg, clock=clock) as conn:
                assert conn.welcome.server_time == dt.datetime(
                    2026, 3, 1, 12, tzinfo=dt.timezone.utc
                )
                frozen.tick(7)
                report = conn.capacity(CapacityReport(sequence=1, capacity=1))
                assert report.server_time == dt.datetime(
                    2026, 3, 1, 12, 0, 7, tzinfo=dt.timezone.utc
                )


def test_a_connection_keeps_real_time_bounds_under_frozen_time() -> None:
    """Under freeze_time, with real-time clocks, a dial completes and an hour of frozen time
    neither times the connection out nor keeps a call from being answered."""
    with (
        freeze_time("2026-03-01 12:00:00") as frozen,
        MockOrbitServer(assignment_rate=None) as server,
    ):
        reg = registration(queue_id=server.queue_id)
        with Client(server.url, server.token).dial_worker(reg) as conn:
            conn.capacity(CapacityReport(sequence=1, capacity=1))
            frozen.tick(3600)
            conn.capacity(CapacityReport(sequence=2, capacity=1))


def test_a_heartbeat_file_goes_stale_as_wall_clock_time_passes(tmp_path: Path) -> None:
    """The heartbeat check measures the file's age in wall-clock time: fresh just after it was
    written, stale once frozen time is past max_age."""
    path = tmp_path / "beat.json"
    HealthProbe().write_heartbeat(path, interval=60.0).close()
    written = dt.datetime.fromtimestamp(path.stat().st_mtime, tz=dt.timezone.utc)
    with freeze_time(written + dt.timedelta(seconds=29)):
        assert check_heartbeat(path, max_age=30) == (True, "ok")
    with freeze_time(written + dt.timedelta(seconds=31)):
        ok, why = check_heartbeat(path, max_age=30)
    assert not ok
    assert why == "heartbeat is 31s old (over 30s)"
