"""Definitions the mock server's Python API, its admin API and its state machine share.

Kept free of websockets so :class:`~orbit_sync.testing.AdminClient` imports without it.
"""

from __future__ import annotations

import datetime as _dt
import re
from typing import TypedDict

from ._snapshots import RetrySafety

__all__ = ["ENQUEUE_OPTIONS", "TOKEN_RE", "EnqueueOptions"]

#: What a bearer token (worker or admin) may look like: the characters
#: :class:`orbit_sync.client.Client` sends (RFC 6750 b64token and the usual opaque-token
#: characters), never spaces or controls, at most 512 of them.
TOKEN_RE = re.compile(r"[A-Za-z0-9\-._~+/=:!#$%&'*^`|]{1,512}")


class EnqueueOptions(TypedDict, total=False):
    """The optional keywords of ``enqueue`` (``MockOrbitServer.enqueue``, ``OrbitState.enqueue``,
    ``POST /admin/v1/tasks``): a task's versions, queue and policy. Defaults are the server's."""

    handler_version: str
    payload_version: str
    queue_id: str | None
    max_attempts: int
    backoff_initial: float
    backoff_max: float
    retry_safety: RetrySafety | str
    deadline: float | _dt.datetime | None
    latest_start: float | _dt.datetime | None
    attempt_time_limit: float | None


#: Their names, in declaration order.
ENQUEUE_OPTIONS: tuple[str, ...] = tuple(EnqueueOptions.__annotations__)
