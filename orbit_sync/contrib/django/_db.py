"""Database connections around each task, as Django does around each request.

Django opens one connection per thread and closes it at the end of a request when it is
unusable or older than ``CONN_MAX_AGE`` (``close_old_connections``, on the ``request_started``
and ``request_finished`` signals). A worker's pool threads never see a request, so without this
each one would keep its connection open forever, broken or not. Celery's Django fixup closes them
before and after each task; so does this listener.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import close_old_connections

from ...worker import TaskContext, WorkerListener

__all__ = ["CloseOldConnections"]


class CloseOldConnections(WorkerListener):
    """Worker middleware: ``django.db.close_old_connections()`` before and after each handler,
    on the handler's own thread (connections belong to the thread that opened them).

    With ``CONN_MAX_AGE = 0`` (Django's default) each task's connection is closed when it ends; a
    persistent connection (``CONN_MAX_AGE > 0`` or ``None``) is kept for the thread's next task
    unless it has expired or errored. A pool thread that retires after being idle takes its
    thread-local connection with it (the DB-API connection is closed when it is collected).
    """

    def around_handler(self, ctx: TaskContext, call: Callable[[], Any]) -> Any:
        # Before: a connection left broken or expired by this thread's previous task (or by a
        # database restart while it was idle) is replaced instead of failing this task.
        close_old_connections()
        try:
            return call()
        finally:
            # After: with CONN_MAX_AGE = 0, or after an error that made it unusable, close it now
            # rather than holding a server connection while the thread waits for work.
            close_old_connections()
