"""The mock server's JSON admin API, on the WebSocket port (see ``docs/mock-server.md``).

Its parts: :mod:`._admin_query` parses arguments (query string or JSON body),
:mod:`._admin_routes` authenticates and routes (:class:`AdminAPI`) to the endpoints of
:mod:`._admin_control`, :mod:`._admin_tasks` and :mod:`._admin_faults` (what they share is in
:mod:`._admin_endpoint`), :mod:`._admin_client` is the client (:class:`AdminClient`, which needs
only ``http.client``); the server's :mod:`._admin_gate` bounds the requests before they reach
the API. This module gathers them.
"""

from __future__ import annotations

from ._admin_client import ADMIN_PREFIX, MAX_WAIT, AdminClient, AdminError, admin_url
from ._admin_endpoint import jsonable
from ._admin_routes import AdminAPI

__all__ = [
    "ADMIN_PREFIX",
    "MAX_WAIT",
    "AdminAPI",
    "AdminClient",
    "AdminError",
    "admin_url",
    "jsonable",
]
