"""Which process wrote a line: under the supervisor, children and the supervisor share one
standard error, so each names itself on every line it writes there.

A child names itself ``worker pid N slot S`` (the slot is its place among the supervisor's N
processes, kept by its replacements), the supervisor ``supervisor pid N``: in the
``orbit-sync ...:`` lines of the command (``report_error``) and, through a formatter wrapped
around each logging handler present when it is called (those the command configured, and those
the application configured at import: a child calls it again once the application is loaded),
at the start of every line of every log record, traceback lines included.
"""

from __future__ import annotations

import logging

__all__ = ["name_this_process"]


class _Named(logging.Formatter):
    """Formats with the handler's own formatter, then puts ``[who]`` before each line."""

    def __init__(self, inner: logging.Formatter | None, who: str) -> None:
        super().__init__()
        self._inner = inner or logging.Formatter()  # a handler without one formats this way
        self._prefix = f"[{who}] "

    def format(self, record: logging.LogRecord) -> str:
        text = self._inner.format(record)
        return "\n".join(self._prefix + line for line in text.split("\n"))


def name_this_process(who: str) -> None:
    """Name this process *who* in its command lines and its log lines (again: handlers added
    since are named too; those named already are left alone)."""
    from .._cli_report import speak_as

    speak_as(who)
    manager = logging.Logger.manager
    loggers = [logging.getLogger(), *manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):  # a PlaceHolder has none
            if not isinstance(handler.formatter, _Named):
                handler.setFormatter(_Named(handler.formatter, who))
