"""The push queues' end marker: how a :class:`~orbit_sync.connection.WorkerConnection`'s bounded
``queue.Queue`` of unread pushes (assignments, cancel notices) tells its takers that the
connection has ended.

The reader puts the marker behind what is still unread as the connection ends; each taker that
gets it puts it back for the next, so every waiting taker wakes and what was received before the
end is still taken first.
"""

from __future__ import annotations

import queue
from typing import Any

#: Put on a push queue once the connection has ended, behind what is still unread: it wakes
#: every waiting taker, each of which puts it back for the next.
ENDED: Any = object()


def end_queue(unread: queue.Queue[Any]) -> None:
    """Put the end marker on *unread* (the reader puts nothing after it)."""
    put_over_bound(unread, ENDED)


def put_over_bound(unread: queue.Queue[Any], item: object) -> None:
    """Put *item* on *unread* past its bound, uncounted: a marker, not a push. A reader waiting
    for room is woken too (it then finds the connection ended)."""
    with unread.mutex:
        unread.queue.append(item)
        unread.not_empty.notify()
        unread.not_full.notify_all()


def put_before_end(unread: queue.Queue[Any], item: object) -> None:
    """Put *item* on *unread* ahead of its end marker, past its bound (the caller holds its
    mutex): received before the connection ended, it is taken before the end."""
    pending = unread.queue
    at = next((i for i, queued in enumerate(pending) if queued is ENDED), len(pending))
    pending.insert(at, item)
    unread.not_empty.notify()
