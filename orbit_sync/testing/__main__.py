"""``python -m orbit_sync.testing``: run a standalone mock Orbit server (same as
``orbit-sync mock-server``; see ``--help``)."""

from __future__ import annotations

import sys

from ..cli import mock_server_main

if __name__ == "__main__":
    sys.exit(mock_server_main())
