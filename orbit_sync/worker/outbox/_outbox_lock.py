"""The outbox's lock file, ``outbox.sqlite-lock`` (empty, 0600): one process owns the outbox;
every handler process holds its instance (docs/outbox.md).

POSIX record locks (``fcntl.lockf``), not ``flock``: they are not inherited by ``fork()``, so a
grandchild a handler forks cannot keep the next worker out. Byte 0 is the owner's (exclusive);
each instance has a byte, held shared by each of its process-executor children while it lives,
and taken exclusively by a later replay before it reports an attempt of the instance lost.

Closing *any* descriptor of the file releases all the process's locks on it: the owner opens it
once (``Outbox``) and refuses a second open in the same process; nothing else (SQLite) opens it.
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
    """Open (creating 0600) *path*, never through a symlink; ``OSError``, or ``ValueError`` saying
    why an existing file must not hold our secrets or locks."""
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
    """Hold *instance_id*'s byte shared while this handler process lives (keep the returned
    descriptor open); ``OSError`` if a later process replays the instance: its worker is gone."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, instance_offset(instance_id))
    except BaseException:
        os.close(fd)
        raise
    return fd
