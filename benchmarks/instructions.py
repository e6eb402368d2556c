"""Instructions per no-op task in our worker process, counted by callgrind: a figure that does not
move with the host's load, so two commits can be compared on a busy machine.

    python benchmarks/instructions.py [--small 200] [--large 800] [--capacity 32]

Runs :mod:`benchmarks._worker_proc` ``noop`` under ``valgrind --tool=callgrind`` twice, draining
``--small`` and then ``--large`` pre-enqueued no-op tasks from the mock server in its own
process (not under valgrind), and prints the difference of the two totals divided by the
difference of the task counts: the instructions one more task costs, start-up and shutdown
cancelled out. The count is of every thread of the worker process (reader, intake, handler
pool, watchdog). Needs valgrind (Debian's ``valgrind``); about a minute.

Callgrind runs the process's threads one at a time, so the count is that of the code, not of
how the host wakes threads: it tells whether a change makes the one path cheaper, while the
``worker CPU/task`` rows of ``make bench`` tell what that is worth in CPU time against the peers.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _server_proc
from benchmarks.run import worker_child

#: The totals line callgrind writes at the end of its output file.
TOTALS = re.compile(r"^(?:totals|summary):\s*(\d+)", re.MULTILINE)


def count(tasks: int, capacity: int, timeout: float) -> int:
    """Instructions of one worker process draining *tasks* no-op tasks, start to exit."""
    server, info = _server_proc.start()
    try:
        server.send({"op": "enqueue", "n": tasks, "handler": "noop"})
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "callgrind.out"
            prefix = ["valgrind", "--tool=callgrind", "-q", f"--callgrind-out-file={out}"]
            extra = ["--tasks", str(tasks), "--capacity", str(capacity)]
            extra += ["--timeout", str(timeout)]
            with worker_child(info, "noop", *extra, prefix=prefix) as child:
                run = child.read()
            if not run.get("ok"):
                raise RuntimeError(f"the worker under callgrind did not finish {tasks} tasks")
            match = TOTALS.search(out.read_text())
            if match is None:
                raise RuntimeError("callgrind wrote no totals line")
            return int(match.group(1))
    finally:
        server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=200, help="tasks in the first run")
    parser.add_argument("--large", type=int, default=800, help="tasks in the second run")
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    if not 0 < args.small < args.large:
        parser.error("--small must be positive and smaller than --large")
    small = count(args.small, args.capacity, args.timeout)
    large = count(args.large, args.capacity, args.timeout)
    per_task = (large - small) / (args.large - args.small)
    print(f"instructions, {args.small} tasks: {small:,}")
    print(f"instructions, {args.large} tasks: {large:,}")
    print(f"instructions per no-op task: {per_task:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
