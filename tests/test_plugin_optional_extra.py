"""The pytest plugin loads in projects that installed orbit-sync without the ``testing`` extra."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from _cli_process import REFUSE_WEBSOCKETS

# Runs in a fresh interpreter with every ``websockets`` import refused, as if it were not installed.
_PROBE = REFUSE_WEBSOCKETS + textwrap.dedent(
    """
    import orbit_sync
    import orbit_sync.testing.pytest_plugin
    import orbit_sync.testing as testing
    assert "websockets" not in sys.modules
    try:
        testing.MockOrbitServer
    except ImportError as exc:
        print("clear error:", exc)
    else:
        raise SystemExit("MockOrbitServer imported without websockets")
    """
)


def test_plugin_and_sdk_import_without_websockets() -> None:
    """Loading the plugin (and the SDK) never needs websockets; using the server says what to do."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'orbit-sync[testing]'" in proc.stdout
