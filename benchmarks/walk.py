"""The walk a reader of the code follows: the modules of ``orbit_sync`` one task crosses in the
worker, from its ``task.assign`` frame to its finish's answer.

    .venv/bin/python benchmarks/walk.py [--calls]

One Worker (capacity 1) and one no-op task on the embedded mock server. A profile hook on the
worker's threads (reader, intake, handler pool, lease watchdog) records each call into a module
of the package from the moment the reader decodes the task's ``task.assign`` until the attempt
is settled (the finish's answer handled). Prints:

- the modules crossed, in the order first entered, and how many;
- the **re-entries**: a call into a module that is already on the calling thread's stack below a
  frame of another module (A calls B, which calls back into A: "down, up and down again"), each
  with the chain of modules that led to it and how often it happened, marked when the chain
  crosses layers (the layers of docs/architecture.md) rather than modules of one layer;
- with ``--calls``, the sequence of module changes, thread by thread.

Leaves every layer uses (``models``, ``_rules``, ``_json``, ``_seconds``, ``clock``) and the
functions attrs and cattrs generate (``generated``) are counted among the modules crossed, but a
call into them is never a re-entry; a generated function counts as part of the module that called
it (cattrs calling back the converter's hooks in ``_bodies`` is no re-entry).
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orbit_sync import Client, Worker
from orbit_sync.testing import MockOrbitServer

#: The worker's threads whose calls make the walk (by name prefix).
WORKER_THREADS = ("orbit-sync-reader", "orbit-handler", "orbit-lease")
#: The layers of docs/architecture.md, from the socket up (the worker is the top one).
LAYERS = {
    "_transport": 0,
    "_codec": 1,
    "_bodies": 1,
    "_protocol": 2,
    "connection": 3,
}
#: Modules every layer calls: crossed, but never a re-entry.
LEAVES = frozenset({"models", "_rules", "_json", "_seconds", "clock"})


def module_of(frame: FrameType) -> str | None:
    """The package module *frame* runs in (``worker.runtime._shell``), or None outside the
    package (the mock server, under ``testing``, is outside: it is the other side of the
    wire)."""
    path = frame.f_code.co_filename.replace("\\", "/")
    if path.startswith("<"):  # code attrs and cattrs generate for a model
        return "generated" if "orbit_sync" in path else None
    if "/orbit_sync/" not in path or "/orbit_sync/testing/" in path:
        return None
    return path.rsplit("/orbit_sync/", 1)[1].removesuffix(".py").replace("/", ".")


class Walk:
    """The profile hook: per thread, the stack of package modules; the calls and re-entries."""

    def __init__(self) -> None:
        self.recording = False
        self.settled = threading.Event()
        self.entered: dict[str, None] = {}  # modules in order first entered
        self.changes: list[tuple[str, str, str]] = []  # (thread, module, function)
        self.reentries: collections.Counter[str] = collections.Counter()
        self._stacks: dict[int, list[str | None]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        thread = threading.current_thread()
        if not thread.name.startswith(WORKER_THREADS):
            return
        stack = self._stacks[thread.ident or 0]
        if event == "return":
            if stack:
                module = stack.pop()
                if module == "worker.runtime._shell" and frame.f_code.co_name == "settle":
                    self.recording = False
                    self.settled.set()
            return
        module = module_of(frame)
        if not self.recording and not self.settled.is_set() and _is_assign(frame):
            self.recording = True  # the walk starts where the reader decodes the task.assign
        if self.recording and module is not None:
            self._record(thread.name, stack, module, frame.f_code.co_name)
        stack.append(module)

    def _record(self, thread: str, stack: list[str | None], module: str, function: str) -> None:
        with self._lock:
            self.entered.setdefault(module, None)
            # Code cattrs generates for the converter is the converter's own (``_bodies``).
            chain = [m for m in stack if m is not None and m != "generated"]
            moved = not chain or chain[-1] != module
            if moved and (not self.changes or self.changes[-1][:2] != (thread, module)):
                self.changes.append((thread, module, function))
            if module in LEAVES or module == "generated" or not chain or chain[-1] == module:
                return
            if module in chain:
                below = chain[chain.index(module) :]
                path = [m for i, m in enumerate(below) if i == 0 or m != below[i - 1]]
                self.reentries[" -> ".join([*path, f"{module}.{function}"])] += 1


def _layer(module: str) -> int:
    return LAYERS.get(module, 4 if module.startswith("worker.") else -1)


def _is_assign(frame: FrameType) -> bool:
    if frame.f_code.co_name not in ("read_server_frame", "decode_server_frame"):
        return False
    raw = frame.f_locals.get("raw")
    return isinstance(raw, bytes | str) and "task.assign" in (
        raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", action="store_true", help="print every module change")
    args = parser.parse_args()
    walk = Walk()
    threading.setprofile(walk.hook)
    with MockOrbitServer() as server:
        worker = Worker(
            Client(server.url, server.token),
            queue_id=server.queue_id,
            capacity=1,
            handle_signals=False,
        )
        worker.register("noop", lambda ctx, payload: None)
        worker.start()
        try:
            server.wait_until(lambda s: any(x.dispatch_enabled for x in s.sessions()), 10)
            task_id = server.enqueue("noop", {})
            server.wait_for(task_id, ["SUCCEEDED"], timeout=10)
            if not walk.settled.wait(10):
                raise SystemExit("the attempt was not settled within 10 s")
        finally:
            worker.stop(timeout=10)
            threading.setprofile(None)  # type: ignore[arg-type]
    modules = list(walk.entered)
    print(f"modules crossed: {len(modules)}")
    for module in modules:
        print(f"  {module}")
    print(f"re-entries (down, up and down again): {sum(walk.reentries.values())}")
    for chain, count in walk.reentries.most_common():
        across = len({_layer(m.split(".<")[0]) for m in chain.split(" -> ")[:-1]}) > 1
        print(f"  {count} x {chain}{'   (across layers)' if across else ''}")
    if args.calls:
        print("module changes, thread by thread:")
        for thread, module, function in walk.changes:
            print(f"  {thread[:22]:<22} {module:<22} {function}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
