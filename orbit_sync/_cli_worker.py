"""``orbit-sync worker MODULE:ATTRIBUTE``: load a Worker, apply the command line, run it (or
hand it to the process supervisor), and turn how it stopped into the exit status.

The command's parts: its options (``_cli_options``), the loading of the module
(``_cli_load``), the banner (``_cli_banner``), and its exit statuses and error lines
(``_cli_report``, which lists what each status means).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any

from ._cli_banner import banner
from ._cli_load import Misuse, load
from ._cli_options import apply_options, export
from ._cli_report import (
    EXIT_FAILED,
    EXIT_FORCED,
    EXIT_OK,
    EXIT_USAGE,
    exit_status_for,
    last_error,
    record_error,
    refused_credentials,
    report_error,
)
from .client import SettingError, check_base_url, check_environment, read_token_file

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["run", "serve"]


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the ``worker`` subcommand; returns the exit status."""
    from ._supervisor import ChildLink
    from ._supervisor import _cli as supervisor_cli

    target: str = args.target
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        hint = (
            f" (e.g. {target.rpartition('.')[0]}:{target.rpartition('.')[2]})"
            if "." in target
            else ""
        )
        parser.error(f"the worker target must look like module:attribute{hint}")
    token: str | None = None
    if args.token_file is not None:
        try:
            token = read_token_file(args.token_file)
        except ValueError as exc:
            # The path is the whole story: one line, not the usage block.
            report_error(f"error: {exc}")
            return EXIT_USAGE
    # Settings that are wrong whatever the module does: one line and exit 2, before it is
    # imported (a module reading them at import would fail with a traceback).
    try:
        if args.url is not None:
            check_base_url(args.url, "--url")
        export(args)
        check_environment(os.environ)
    except ValueError as exc:
        report_error(f"error: {exc}")
        return EXIT_USAGE
    if supervisor_cli.requested(args):
        # The supervisor imports nothing of the application: each child does, afresh.
        level = getattr(args, "log_level", "WARNING")
        command = [sys.executable, "-m", "orbit_sync", "--log-level", level, "worker", target]
        return supervisor_cli.supervise(
            args, [*command, *supervisor_cli.child_arguments(args)], target
        )
    link = ChildLink.from_environ()
    status = _run(args, parser, target, token, link)
    if link is not None:
        link.exit(status, last_error())
    return status


def _run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    target: str,
    token: str | None,
    link: Any,
) -> int:
    from .worker import Worker

    module_name, _, attribute = target.partition(":")
    try:
        worker = load(target, module_name, attribute)
    except (SettingError, Misuse) as exc:  # the module's configuration: not a bug to trace
        report_error(f"cannot load {target}: {exc}")
        return EXIT_USAGE
    if worker is None:
        return EXIT_FAILED
    try:
        worker = apply_options(worker, args, token)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    assert isinstance(worker, Worker)
    return serve(worker, target, link)


def serve(worker: Worker, label: str, link: Any = None) -> int:
    """Print the banner, run *worker* until it stops, report; return the exit status.

    *link* (a supervised child's :class:`~orbit_sync._supervisor.ChildLink`) reports the
    worker's health to the supervisor and applies the recycling limits.
    """
    if link is not None:
        try:
            link.attach(worker)
        except ValueError as exc:  # a recycling limit this process cannot meet
            # The supervisor's own option: it says so once, for all its processes.
            record_error(f"error: {exc}")
            return EXIT_USAGE
        if link.stop_requested:
            report_error("asked to stop before the worker started: not starting")
            return EXIT_OK
    banner(worker, label, link)
    said = _SaidAtStop(worker.client)
    worker.options.logger.addFilter(said)
    try:
        report = worker.run()
    except Exception as exc:
        # The worker's errors never carry secrets (errors.py); show the type and message.
        status = exit_status_for(exc)
        hint = refused_credentials(exc, worker.client)
        why = f"; {hint}" if hint else ""
        report_error(f"worker stopped on {type(exc).__name__}: {exc}{why} (exit {status})")
        if status == EXIT_FAILED:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        return status
    finally:
        worker.options.logger.removeFilter(said)
    forced = bool(not report.drained or report.abandoned or report.unreported)
    status = EXIT_FORCED if forced else EXIT_OK
    report_error(
        f"worker stopped (drained={report.drained}, cancelled={len(report.cancelled)},"
        f" abandoned={len(report.abandoned)}, unreported={len(report.unreported)}; exit {status})"
    )
    return status


class _SaidAtStop(logging.Filter):
    """Drops the worker's own log line about a refusal of the credentials: the line the command
    prints as the worker stops says the same, and what the refusal means (one line, not two)."""

    def __init__(self, client: object) -> None:
        super().__init__()
        self._client = client

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(
            isinstance(arg, BaseException) and refused_credentials(arg, self._client)
            for arg in args
        )
