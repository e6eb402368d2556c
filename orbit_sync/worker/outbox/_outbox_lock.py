"""The outbox's lock file, ``outbox.sqlite-lock`` (empty, mode 0600): one process owns the
outbox; every handler process holds its instance.

POSIX record locks (``fcntl.lockf``), not ``flock``: a record lock belongs to the *process* that
took it and is not inherited by ``fork()``, so a grandchild a handler forks cannot keep the next
worker from opening the outbox (docs/outbox.md). And byte ranges let one file carry many locks:
byte 0 is the owner's (exclusive), and each worker *instance* has a byte of its own, held shared
by every process-executor child of that instance while it lives; a later process's replay takes
that byte exclusively before it reports an attempt of the instance lost.

The price: closing *any* descriptor of the file releases every lock the process holds on it. So
a process opens the lock file once (:class:`LockFile`), every lock of the process goes through
that descriptor, and a second open in the same process is refused before it can touch the file.
Nothing else (SQLite included) ever opens it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import stat
import threading
import time
from collections.abc import Iterator

from ..._realtime import monotonic

__all__ = ["LockFile", "hold_instance_shared", "instance_offset", "lock_path", "open_private"]

#: How often a bounded wait for an instance's lock tries again.
_POLL = 0.05

_open_lock = threading.Lock()
#: (st_dev, st_ino) of every lock file this process has open: see the module docstring.
_open_files: set[tuple[int, int]] = set()


class LockBusy(Exception):
    """Another process holds the lock."""


class HeldHere(LockBusy):
    """This process holds the lock already (another outbox of this process has the file)."""


def lock_path(outbox_path: str) -> str:
    """The lock file of the outbox at *outbox_path*."""
    return outbox_path + "-lock"


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


class LockFile:
    """The owner's handle on an outbox's lock file (one per process and file)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with _open_lock:
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                if (info.st_dev, info.st_ino) in _open_files:
                    # Opening it again and closing that would drop this process's locks.
                    raise HeldHere
            fd = open_private(path)
            info = os.fstat(fd)
            key = (info.st_dev, info.st_ino)
            if key in _open_files:  # replaced by the same file under our feet
                raise HeldHere
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
            except OSError:
                os.close(fd)  # this process held no lock on it: nothing is dropped
                raise LockBusy from None
            _open_files.add(key)
        self._fd = fd
        self._key = key

    @contextlib.contextmanager
    def instance(self, instance_id: str, timeout: float) -> Iterator[bool]:
        """Hold *instance_id*'s byte exclusively (yields True), waiting up to *timeout* seconds
        for that instance's handler processes to be gone; yields False if they are not."""
        offset = instance_offset(instance_id)
        end = monotonic() + timeout
        while True:
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
                break
            except OSError:
                if monotonic() >= end:
                    yield False
                    return
                time.sleep(_POLL)  # no blocking lock with a timeout exists: poll
        try:
            yield True
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, offset)

    def close(self) -> None:
        """Release every lock (safe twice)."""
        with _open_lock:
            if self._fd < 0:
                return
            os.close(self._fd)
            self._fd = -1
            _open_files.discard(self._key)


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
