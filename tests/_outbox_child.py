"""A worker process with a durable outbox, for the kill -9 tests.

    python tests/_outbox_child.py URL QUEUE_ID OUTBOX DIR MODE     (token in $ORBIT_TEST_TOKEN)

Handler ``work`` writes ``started-<pid>`` into DIR, then with MODE ``hang`` blocks forever (the
test kills the process mid-handler) or with MODE ``return`` returns ``{"n": ..., "pid": ...}``.
With MODE ``fork`` it first forks a grandchild that stays (``grandchild-<pid>`` in DIR) and
returns. With MODE ``process``, ``work`` is ``_process_handlers.effect`` on the process executor
(one child, ``cancel_grace`` 1 s). With MODE ``diskfull`` the handler makes every later file
write of the process fail (as on a full disk) and returns. OUTBOX ``-`` runs without an outbox.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # make the package importable from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orbit_sync.client import Client
from orbit_sync.worker import Backoff, TaskContext, Worker


def _fork_grandchild(directory: str) -> None:
    """Fork a process that outlives the worker (as a daemonizing library would) and writes
    ``grandchild-<pid>`` into *directory*; return once it exists."""
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # as a daemon does: the test reads the worker's stderr to its end
            os.dup2(null, fd)
        Path(directory, f"grandchild-{os.getpid()}").write_text("")
        os.write(ready_w, b"x")
        time.sleep(3600)  # the test kills it
        os._exit(0)
    os.read(ready_r, 1)
    os.close(ready_r)
    os.close(ready_w)


def main(url: str, queue_id: str, outbox: str, directory: str, mode: str) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    worker = Worker(
        Client(url, os.environ["ORBIT_TEST_TOKEN"]),
        queue_id=queue_id,
        capacity=2,
        outbox=None if outbox == "-" else outbox,
        reconnect_backoff=Backoff(initial=0.05, maximum=0.2),
        process_pool=1,
        cancel_grace=1.0,
    )
    if mode == "process":
        import _process_handlers  # beside this script: the child imports it by name too

        worker.register("work", _process_handlers.effect, executor="process")
        worker.run()
        return 0
    if mode == "diskfull":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
    never = threading.Event()

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        Path(directory, f"started-{os.getpid()}").write_text("")
        print(f"started-{os.getpid()}", flush=True)  # what the test waits for
        if mode == "fork":
            _fork_grandchild(directory)
        if mode == "diskfull":
            # From here on no file of this process may grow: the disk is "full".
            resource.setrlimit(resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))
        if mode == "hang":
            never.wait()
        return {"n": payload["n"], "pid": os.getpid()}

    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:6]))
