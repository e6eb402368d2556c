"""``python -m orbit_sync``: the ``orbit-sync`` command without its console script (the worker
supervisor starts its children this way, with the interpreter it runs on)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="orbit-sync"))
