"""One rule for "a number of seconds" (orbit_sync._seconds), and every caller uses it."""

from __future__ import annotations

import argparse
import math

import pytest

from orbit_sync._protocol import CALL_TIMEOUT, call_timeout
from orbit_sync._seconds import parse_seconds, seconds, wait_seconds


@pytest.mark.parametrize("bad", [True, "1", None, [1]])
def test_non_numbers_are_a_type_error(bad: object) -> None:
    """Booleans, strings, None and containers are not seconds."""
    with pytest.raises(TypeError, match="delay must be a number of seconds"):
        seconds(bad, "delay")


@pytest.mark.parametrize(
    ("value", "positive", "message"),
    [
        (math.nan, False, "not NaN"),
        (-0.5, False, ">= 0"),
        (0, True, "> 0"),
        (math.inf, False, "finite"),
    ],
)
def test_the_value_rules(value: float, positive: bool, message: str) -> None:
    """NaN, negatives, zero where it must be positive and infinity without a cap are refused."""
    with pytest.raises(ValueError, match=message):
        seconds(value, "delay", positive=positive)


def test_infinity_means_the_cap_or_no_bound_where_those_exist() -> None:
    """With a cap infinity is the cap; for a wait it (and None) is no bound."""
    assert seconds(math.inf, "t", cap=8.0) == 8.0
    assert seconds(3, "t", cap=8.0) == 3.0
    assert wait_seconds(math.inf) is None and wait_seconds(None) is None
    assert wait_seconds(0) == 0.0
    with pytest.raises(ValueError, match="not NaN"):
        wait_seconds(math.nan)
    with pytest.raises(TypeError, match="or None"):
        wait_seconds("1")


def test_the_call_timeout_cap_has_one_home() -> None:
    """A call's bound: None or infinity is the cap, larger values are capped, zero is refused."""
    assert call_timeout(None) == CALL_TIMEOUT == call_timeout(math.inf) == call_timeout(99)
    assert call_timeout(2, cap=1.0) == 1.0
    with pytest.raises(ValueError, match="max_call_timeout must be > 0"):
        call_timeout(0, "max_call_timeout")


@pytest.mark.parametrize("text", ["nan", "inf", "-1", "soon"])
def test_the_command_line_uses_the_same_rules(text: str) -> None:
    """parse_seconds refuses what seconds() refuses, as an argparse error."""
    with pytest.raises(argparse.ArgumentTypeError):
        parse_seconds(text)
    assert parse_seconds("0") == 0.0
    with pytest.raises(argparse.ArgumentTypeError, match="> 0"):
        parse_seconds("0", positive=True)


def test_every_caller_refuses_nan_the_same_way(capsys: pytest.CaptureFixture[str]) -> None:
    """The client, the connection, the Worker and both command lines all refuse NaN."""
    from orbit_sync import Client, Worker
    from orbit_sync.cli import main

    client = Client("ws://127.0.0.1:1", "t" * 24)
    from _scripted import registration

    with pytest.raises(ValueError, match="not NaN"):
        client.dial_worker(registration(), timeout=math.nan)
    with pytest.raises(ValueError, match="not NaN"):
        Worker(client, queue_id="a" * 32, drain_timeout=math.nan)
    for argv in (
        ["worker", "app:worker", "--drain-timeout", "nan"],
        ["mock-server", "--lease-duration", "nan"],
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        assert f"argument {argv[-2]}: the value must be a number of seconds, not NaN" in (
            capsys.readouterr().err
        )


def test_health_backoff_and_clocks_refuse_nan_and_infinity() -> None:
    """Health probes, heartbeat checks, backoff bounds and clock steps follow the one rule."""
    from orbit_sync import SystemClock
    from orbit_sync.contrib.health import (
        FileHeartbeat,
        HealthProbe,
        HealthServer,
        check_heartbeat,
        main,
    )
    from orbit_sync.testing import ManualClock, MockOrbitServer
    from orbit_sync.testing._clock import ServerTime
    from orbit_sync.worker import Backoff

    probe = HealthProbe()
    makers = [
        lambda v: HealthProbe(stale_after=v),
        lambda v: FileHeartbeat(probe, "unused", v),
        lambda v: HealthServer(probe, "127.0.0.1", 0, timeout=v),
        lambda v: Backoff(maximum=v),
        lambda v: check_heartbeat("missing", v),
        lambda v: ManualClock(0.0).advance(v),
        lambda v: ServerTime(SystemClock()).advance(v),
        lambda v: MockOrbitServer(clock=ManualClock(0.0)).advance(v),
    ]
    for make in makers:
        with pytest.raises(ValueError, match="not NaN"):
            make(math.nan)
        with pytest.raises(ValueError, match="finite"):
            make(math.inf)
        with pytest.raises(TypeError, match="must be a number of seconds"):
            make("1")
    with pytest.raises(SystemExit):
        main(["missing", "--max-age", "nan"])
