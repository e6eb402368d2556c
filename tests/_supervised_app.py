"""The worker module the supervisor tests run (copied into the test's directory).

Handlers print ``<what> <pid> <n>`` on stdout (children share the supervisor's stdout), so a test
sees which process ran what.
"""

import os
import sys
import threading
import time

from orbit_sync.client import Client
from orbit_sync.worker import Worker
from orbit_sync.worker.process._process_limits import rss_bytes

LEAK: list[bytes] = []


def make() -> Worker:
    worker = Worker(
        Client(os.environ["ORBIT_URL"], os.environ["ORBIT_TOKEN"]),
        queue_id=os.environ["ORBIT_QUEUE_ID"],
        capacity=int(os.environ.get("APP_CAPACITY", "2")),
        drain_timeout=float(os.environ.get("APP_DRAIN", "10")),
        cancel_grace=1.0,
        flush_timeout=2.0,
    )

    @worker.handler("echo")
    def echo(ctx, payload):
        marks = os.environ.get("APP_MARKS")
        if marks:  # one line per run of a handler: a test counts runs per attempt
            with open(marks, "a") as out:
                out.write(f"{ctx.attempt_id} {os.getpid()}\n")
        delay = float(os.environ.get("APP_DELAY", "0"))
        if delay:
            time.sleep(delay)
        if not os.environ.get("APP_QUIET"):
            print("handled", os.getpid(), payload["n"], flush=True)
        return {"pid": os.getpid(), "n": payload["n"]}

    @worker.handler("leak")
    def leak(ctx, payload):
        LEAK.append(os.urandom(1024 * 1024))  # 1 MB that is never freed (and really touched)
        return {"pid": os.getpid(), "rss": rss_bytes()}

    @worker.handler("gate")
    def gate(ctx, payload):
        # Blocks until the test writes to the FIFO named in the payload. Opened read-write,
        # which never waits for a writer: once "started" is out, the test's write finds a reader.
        with os.fdopen(os.open(payload["fifo"], os.O_RDWR)) as fifo:
            print("started", os.getpid(), payload["n"], flush=True)
            return {"line": fifo.readline().strip(), "pid": os.getpid()}

    @worker.handler("slow")
    def slow(ctx, payload):
        print("started", os.getpid(), payload["n"], flush=True)
        ctx.sleep(120)  # returns early (TaskCancelled) only when cancelled

    @worker.handler("hang")
    def hang(ctx, payload):
        # Blocked in C for good: a time limit's interrupt never lands, only a new process helps.
        print("started", os.getpid(), payload["n"], flush=True)
        threading.Event().wait()

    return worker


def broken() -> Worker:
    raise RuntimeError("this factory always fails")


if os.environ.get("APP_IMPORT_ERROR"):
    print("app import fails on purpose", file=sys.stderr)
    raise ImportError("no module named surely_missing")
