"""What a supervised worker process and its supervisor tell each other.

The supervisor starts each child with two pipes and an environment variable (:data:`ENV`, JSON:
the pipes' descriptors and the child's limits). The child writes one JSON object per line to the
*status* pipe. It reads commands from the *control* pipe, one byte each (:data:`DRAIN`,
:data:`STOP_NOW`); only the supervisor holds its writing end, so the read returns end-of-file
once the supervisor is gone, however it died.

Child -> supervisor messages (``kind``):

- ``hello``: the worker is built; its ``drain_timeout``, ``cancel_grace`` and ``flush_timeout``
  (the supervisor's stop deadline is computed from them);
- ``state``: the child's :meth:`~orbit_sync.contrib.health.HealthProbe.state`, every
  :data:`STATE_INTERVAL` seconds and at once when the session comes up or the worker drains;
- ``recycle``: the child passed a recycling limit (``reason``) and drains now: the supervisor
  starts its replacement at once;
- ``exit``: the exit ``status`` and the one-line ``message`` the child printed about it.

Each line is far below ``PIPE_BUF`` (4096 bytes), so lines written by different threads never
interleave.
"""

from __future__ import annotations

import json
import os
from typing import Any

import attrs

__all__ = ["DRAIN", "ENV", "STATE_INTERVAL", "STOP_NOW", "ChildSettings", "LineReader", "encode"]

#: The environment variable that makes ``orbit-sync worker`` (or ``manage.py orbit_worker``) a
#: supervised child. The child removes it, so its own children never see it.
ENV = "ORBIT_SYNC_SUPERVISED"
#: Seconds between two ``state`` messages of a child.
STATE_INTERVAL = 0.5
#: Control commands: drain (the first signal), stop now (the second).
DRAIN = b"d"
STOP_NOW = b"s"
#: A line longer than this is not a message of ours: the reader drops it.
MAX_LINE = 65536


@attrs.frozen
class ChildSettings:
    """What a child learns from :data:`ENV`."""

    status_fd: int
    control_fd: int
    supervisor_pid: int
    slot: int
    max_tasks: int | None = None
    max_memory_mb: int | None = None
    max_stuck: int | None = None
    metrics: bool = False
    #: The pid of the process this one replaces in its slot (recycled or restarted), if any.
    replaces: int | None = None

    def to_env(self) -> str:
        """The value of :data:`ENV`."""
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_env(cls, value: str) -> ChildSettings:
        """Parse the value of :data:`ENV`; ValueError if it is not ours."""
        try:
            data = json.loads(value)
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed ${ENV}") from exc


def encode(kind: str, **fields: Any) -> bytes:
    """One message line."""
    return json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode() + b"\n"


class LineReader:
    """Splits what a non-blocking pipe delivers into messages; :attr:`eof` once it is closed."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.eof = False
        self._buffer = b""

    def read(self) -> list[dict[str, Any]]:
        """The complete messages available now (malformed lines are dropped)."""
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return []
        except OSError:
            chunk = b""
        if not chunk:
            self.eof = True
            return []
        lines = (self._buffer + chunk).split(b"\n")
        self._buffer = lines.pop()
        if len(self._buffer) > MAX_LINE:
            self._buffer = b""
        messages = []
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict) and isinstance(message.get("kind"), str):
                messages.append(message)
        return messages
