"""The supervisor's command-line options, shared by ``orbit-sync worker`` and
``manage.py orbit_worker``: which ask for a supervisor, and each child's own command line."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["add_arguments", "child_arguments", "requested", "supervise"]

#: One process per core is the usual choice; past this a typo is more likely than a host.
MAX_PROCESSES = 1024


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError("expected a whole number >= 1")
    return int(text)


def _processes(text: str) -> int:
    value = _positive(text)
    if value > MAX_PROCESSES:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_PROCESSES}")
    return value


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError("expected a port number from 0 to 65535")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--processes`` and its companions."""
    group = parser.add_argument_group(
        "processes", "run several worker processes under one supervisor (docs/deploy.md)"
    )
    group.add_argument(
        "--processes",
        type=_processes,
        metavar="N",
        help="run N worker processes under a supervisor (default: one process, no supervisor)",
    )
    group.add_argument(
        "--max-tasks-per-child",
        type=_positive,
        metavar="K",
        help="recycle a worker process after K tasks: it drains while its replacement starts",
    )
    group.add_argument(
        "--max-memory-per-child",
        type=_positive,
        metavar="MB",
        help="recycle a worker process whose RSS exceeds MB after a task (checked after each)",
    )
    group.add_argument(
        "--max-stuck-per-child",
        type=_positive,
        metavar="N",
        help="recycle a worker process once N of its slots are held by handlers past their"
        " time limit that could not be stopped: it drains while its replacement starts"
        " (default: 1)",
    )
    group.add_argument(
        "--health-port",
        type=_port,
        metavar="PORT",
        help="serve /livez, /readyz, /healthz for every worker process on PORT",
    )
    group.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve the Prometheus metrics of every worker process, summed, on PORT",
    )
    group.add_argument(
        "--http-host",
        metavar="HOST",
        default=None,
        help="address the health and metrics ports listen on (default 127.0.0.1: this machine"
        " only; 0.0.0.0 for a Kubernetes probe or a Prometheus scrape from elsewhere)",
    )


def _option(options: Any, name: str) -> Any:
    """*name* from parsed options: an ``argparse.Namespace`` (``orbit-sync``) or a dict
    (Django's ``handle(**options)``)."""
    if isinstance(options, dict):
        return options.get(name)
    return getattr(options, name, None)


def requested(options: Any) -> bool:
    """Whether the command line asks for a supervisor: ``--processes``, or an option only a
    supervisor can honour."""
    return any(
        _option(options, name) is not None
        for name in (
            "processes",
            "max_tasks_per_child",
            "max_memory_per_child",
            "max_stuck_per_child",
            "health_port",
            "metrics_port",
        )
    )


def child_arguments(options: Any) -> list[str]:
    """The worker options a child repeats (the supervisor's own are left out)."""
    argv: list[str] = []
    for name in (
        "url",
        "queue",
        "token_file",
        "capacity",
        "drain_timeout",
        "first_connect_timeout",
        "time_limit",
    ):
        value = _option(options, name)
        if value is None:
            continue
        if name == "token_file":  # children may run elsewhere than the current directory
            value = os.path.abspath(value)
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def supervise(options: Any, command: Sequence[str], label: str) -> int:
    """Run the supervisor over children running *command*; the exit status."""
    from .._cli_report import EXIT_USAGE, report_error
    from ._observe import MetricsTarget
    from ._speaker import name_this_process
    from ._supervisor import Supervisor, SupervisorOptions

    def get(name: str) -> Any:
        return _option(options, name)

    if os.name != "posix":  # inherited pipes and sessions
        report_error("--processes and the recycling options need Linux or macOS")
        return EXIT_USAGE
    if get("metrics_port") is not None and (why := MetricsTarget.check()) is not None:
        report_error(why)
        return EXIT_USAGE
    name_this_process(f"supervisor pid {os.getpid()}")
    supervisor = Supervisor(
        SupervisorOptions(
            processes=get("processes") or 1,
            command=tuple(command),
            label=label,
            max_tasks_per_child=get("max_tasks_per_child"),
            max_memory_per_child=get("max_memory_per_child"),
            max_stuck_per_child=get("max_stuck_per_child") or 1,
            health_port=get("health_port"),
            metrics_port=get("metrics_port"),
            http_host=get("http_host") or "127.0.0.1",
        ),
        out=report_error,
    )
    try:
        return supervisor.run()
    except OSError as exc:  # a port in use, say
        report_error(f"supervisor could not start: {exc}")
        return EXIT_USAGE
