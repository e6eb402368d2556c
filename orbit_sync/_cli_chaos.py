"""``orbit-sync chaos module:attr``: a chaos run of the Worker a module defines (the one
``orbit-sync worker`` would run), against a mock server through a faulty link, then its summary
table; the exit status says whether the worker's promises held and the handler's effects
happened once (docs/mock-server.md, "Chaos runs")."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from typing import Any

import attrs

from ._cli_load import load
from ._cli_report import EXIT_FAILED, EXIT_OK, EXIT_USAGE, report_error

__all__ = ["DESCRIPTION", "add_arguments", "run"]

DESCRIPTION = """\
Run the Worker that TARGET names (module:attribute, a Worker or a function without arguments
that returns one, as for `orbit-sync worker`) against a mock Orbit server in this process,
through a link that cuts, stalls and loses answers on a schedule drawn from --seed, while the
worker is replaced as a deploy would (SIGTERM's drain, a fresh worker). Then it checks that
every task ended, that no attempt's handler ran twice, that no two attempts of a task ran at
once, that every result reached the server, and that no handler ran past its lease
uncancelled; a handler that calls orbit_sync.testing.chaos.effect(ctx) is also told whether
its effect happened more than once for a task (not idempotent).

The same seed draws the same fault schedule every time; what each fault hits depends on how
the threads interleave, so two runs of one seed may differ in their details.

Exit status: 0 all held, 1 a violation or a non-idempotent handler (the summary names each
one, with the seed and the command that replays it), 2 a usage error or a module that does
not load.
"""

#: The fault knobs (FaultRates fields) the command line sets, each overriding the profile's.
_KNOBS = (
    ("cut_every", "mean finished attempts between two connection cuts ('none': never)"),
    ("delay_every", "mean finished attempts between two link stalls ('none': never)"),
    ("delay_seconds", "mean length of a stall (s)"),
    ("lost_ack_every", "mean finished attempts between two lost answers ('none': never)"),
    ("duplicate_every", "mean finished attempts between two repeated assignments"),
    ("lease_expiry_every", "mean finished attempts between two leases the server expires"),
    ("restart_every", "mean finished attempts between two deploys ('none': never)"),
    ("rtt", "seconds every round trip on the link takes"),
    ("lease", "the server's lease window (s, 1-120)"),
)
#: Knobs that are a spacing: 'none' turns the fault off.
_SPACINGS = frozenset(name for name, _ in _KNOBS if name.endswith("_every"))


#: What ``none`` on the command line stands for (argparse keeps None for "not given").
_OFF = "none"


def _number(text: str) -> float | str:
    if text.lower() == _OFF:
        return _OFF
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', not {text!r}") from None


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError("expected a whole number >= 1")
    return int(text)


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``chaos`` subcommand's arguments."""
    from .testing._chaos_plan import PROFILES

    parser.add_argument("target", help="module:attribute naming a Worker (or a factory of one)")
    parser.add_argument("--seed", type=_seed, default=0, help="the fault schedule's seed")
    parser.add_argument("--tasks", type=_count, default=100, help="tasks to run (default 100)")
    parser.add_argument(
        "--profile", default="default", choices=sorted(PROFILES), help="the named fault profile"
    )
    parser.add_argument("--handler", help="the handler to run (needed when there are several)")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=300.0,
        help="seconds every task gets to end (default 300)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    for name, text in _KNOBS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=_number, help=text)


def _rates(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Any, dict[str, Any]]:
    """The profile's FaultRates with the command line's knobs applied, and the knobs given."""
    from .testing._chaos_plan import profile

    knobs: dict[str, Any] = {}
    for name, _ in _KNOBS:
        value = getattr(args, name)
        if value is None:
            continue
        if value == _OFF and name not in _SPACINGS:
            parser.error(f"--{name.replace('_', '-')} takes a number, not 'none'")
        knobs[name] = None if value == _OFF else value
    try:
        return attrs.evolve(profile(args.profile), **knobs), knobs
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))


def _replay(args: argparse.Namespace, knobs: dict[str, Any]) -> str:
    words = [
        args.target,
        "--seed",
        str(args.seed),
        "--tasks",
        str(args.tasks),
        "--profile",
        args.profile,
    ]
    if args.handler is not None:
        words += ["--handler", args.handler]
    for name, value in knobs.items():
        words += [f"--{name.replace('_', '-')}", "none" if value is None else f"{value:g}"]
    return f"orbit-sync chaos {shlex.join(words)}"


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the ``chaos`` subcommand; returns the exit status."""
    from .testing import chaos

    rates, knobs = _rates(args, parser)
    target: str = args.target
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        parser.error("the target must look like module:attribute")
    # The module may build its Worker from the environment: give it settings to read. The run
    # points its workers at its own mock server and never dials these.
    os.environ.setdefault("ORBIT_URL", "ws://127.0.0.1:9")
    os.environ.setdefault("ORBIT_TOKEN", "chaos-run-placeholder")
    os.environ.setdefault("ORBIT_QUEUE_ID", "c" * 32)
    try:
        worker = load(target, module_name, attribute)
    except ValueError as exc:  # SettingError and the module's misuse of the API
        report_error(f"cannot load {target}: {exc}")
        return EXIT_USAGE
    if worker is None:
        return EXIT_USAGE
    if not logging.getLogger().isEnabledFor(logging.INFO):
        # Every cut logs a lost connection: at the default level those lines would bury the
        # progress and the table.
        logging.getLogger("orbit_sync").setLevel(logging.CRITICAL)

    def progress(p: chaos.Progress) -> None:
        if not args.quiet:
            print(p, file=sys.stderr, flush=True)

    try:
        report = chaos.run(
            worker,
            seed=args.seed,
            tasks=args.tasks,
            profile=args.profile,
            rates=rates if knobs else None,
            handler=args.handler,
            time_limit=args.time_limit,
            progress=progress,
            replay=_replay(args, knobs),
        )
    except (TypeError, ValueError) as exc:
        report_error(f"error: {exc}")
        return EXIT_USAGE
    print(report.summary(), flush=True)
    return EXIT_OK if report.ok else EXIT_FAILED
