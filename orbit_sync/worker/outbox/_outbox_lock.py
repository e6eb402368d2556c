"""The outbox's lock file, ``outbox.sqlite-lock`` (empty, mode 0600): one process owns the
outbox; every handler process holds its instance.

POSIX record locks (``fcntl.lockf``), not ``flock``: a record lock belongs to the *process* that
took it and is not inherited by ``fork()``, so a grandchild a handler forks cannot keep the next
worker from opening the outbox (docs/outbox.md). And byte ranges let one file carry many locks:
byte 0 is the owner's (exclusive), and each worker *instance* has a byte of its own, held shared
by every process-executor child of that instance while it lives; a later process's replay takes
that byte exclusively before it reports an attempt of the instance lost.

The price: closing *any* descriptor of the file releases every lock the process holds on it. So
the owner opens the lock file once (``Outbox``), every lock of the process goes through that
descriptor, and a second open in the same process is refused before it can touch the file.
Nothing else (SQLite included) ever opens it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat

__all__ = ["hold_instance_shared", "instance_offset", "open_private"]


def instance_offset(instance_id: str) -> int:
    """The byte of *instance_id* in the lock file (never 0, the owner's; 56 bits: no clash)."""
    digest = hashlib.sha256(instance_id.encode()).digest()
    return 1 + int.from_bytes(digest[:7], "big")


def open_private(path: str) -> int:
    """Open (creating 0600) *path*, never through a symlink; raises ``OSError``, or
    ``ValueError`` saying why an existing file must not hold secrets or locks of ours."""
    flags = os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    fd = os.open(path, flags)
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif info.st_uid != os.geteuid():
        problem = "belongs to another user"
    elif info.st_mode & 0o077:
        problem = (
            f"can be read or written by other users (mode {stat.S_IMODE(info.st_mode):o}); "
            "it holds secrets: chmod 600 it"
        )
    if problem is not None:
        os.close(fd)
        raise ValueError(problem)
    return fd


def hold_instance_shared(path: str, instance_id: str) -> int:
    """In a handler process: hold *instance_id*'s byte shared for as long as this process lives;
    return the descriptor (keep it open). ``OSError`` when it cannot: the instance is being
    replayed by a later process, so its worker is gone."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, instance_offset(instance_id))
    except BaseException:
        os.close(fd)
        raise
    return fd
