"""``manage.py orbit_worker``: run an Orbit worker with the installed apps' handlers."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from orbit_sync import _cli_load, _cli_options, _cli_report, _cli_worker
from orbit_sync._supervisor import ChildLink
from orbit_sync._supervisor import _cli as supervisor_cli
from orbit_sync.client import Client, read_token_file, set_token_source
from orbit_sync.contrib.django._worker import build_worker, discover_handlers


class Command(BaseCommand):  # type: ignore[misc]  # Django ships no type hints
    help = (
        "Run an Orbit worker with the handlers declared (@orbit_sync.contrib.django.handler) in "
        "each installed app's orbit_tasks.py, until SIGTERM/SIGINT (the first drains, a second "
        "stops at once). Settings: ORBIT_SYNC, else $ORBIT_URL, $ORBIT_TOKEN (or "
        "$ORBIT_TOKEN_FILE), $ORBIT_QUEUE_ID. " + _cli_options.EXIT_SUMMARY
    )

    def add_arguments(self, parser: CommandParser) -> None:
        _cli_options.add_arguments(parser, target=False)
        parser.add_argument(
            "--log-level",
            choices=["DEBUG", "INFO", "WARNING", "ERROR"],
            help="log orbit_sync at this level on standard error (default: per settings.LOGGING)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["log_level"]:
            _log_to_stderr(options["log_level"])
        token = None
        if options["token_file"] is not None:
            try:
                token = read_token_file(options["token_file"])
            except ValueError as exc:
                raise CommandError(str(exc), returncode=_cli_report.EXIT_USAGE) from None
        if supervisor_cli.requested(options):
            status = supervisor_cli.supervise(
                options,
                [*_command_prefix(), *_child_arguments(options)],
                "manage.py orbit_worker",
            )
            if status:
                sys.exit(status)
            return
        link = ChildLink.from_environ()
        try:
            # Both read settings.ORBIT_SYNC: a misspelled key is configuration, like a missing URL.
            discover_handlers()
            worker = build_worker(
                url=options["url"],
                token=token,
                queue_id=options["queue"],
                capacity=options["capacity"],
                drain_timeout=options["drain_timeout"],
                time_limit=options["time_limit"],
            )
        except Exception as exc:
            # Configuration, not a bug: the message, not a traceback (and never the token). A
            # TypeError counts when orbit-sync raised it: a handler's time_limit="5", say.
            if not isinstance(exc, ImproperlyConfigured | ValueError) and not _cli_load.misuse(exc):
                raise
            raise CommandError(str(exc), returncode=_cli_report.EXIT_USAGE) from None
        if options["token_file"] is not None and isinstance(worker.client, Client):
            set_token_source(worker.client, f"--token-file {options['token_file']}")
        if options["first_connect_timeout"] is not None:
            worker = worker.with_options(first_connect_timeout=options["first_connect_timeout"])
        status = _cli_worker.serve(worker, "manage.py orbit_worker", link)
        if link is not None:
            link.exit(status, _cli_report.last_error())
        if status:
            sys.exit(status)


def _command_prefix() -> list[str]:
    """How a child runs this command again: the same manage.py (or django-admin) script, else
    ``python -m django`` (which finds the settings in $DJANGO_SETTINGS_MODULE, inherited)."""
    script = sys.argv[0]
    if os.path.isfile(script) and os.path.basename(script) != "__main__.py":
        return [sys.executable, os.path.abspath(script), "orbit_worker"]
    return [sys.executable, "-m", "django", "orbit_worker"]


def _child_arguments(options: dict[str, Any]) -> list[str]:
    argv = supervisor_cli.child_arguments(options)
    if options.get("log_level"):
        argv += ["--log-level", options["log_level"]]
    if options.get("settings"):
        argv += ["--settings", options["settings"]]
    if options.get("pythonpath"):
        argv += ["--pythonpath", options["pythonpath"]]
    return argv


def _log_to_stderr(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("orbit_sync")
    root.addHandler(handler)
    root.setLevel(level)
