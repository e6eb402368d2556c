"""Django integration: ``manage.py orbit_worker`` runs the handlers of the installed apps.

::

    # settings.py
    INSTALLED_APPS = [..., "orbit_sync.contrib.django"]

    # billing/orbit_tasks.py (imported from every installed app by the command)
    from orbit_sync.contrib.django import handler

    @handler("invoice.charge")
    def charge(ctx, payload):
        Invoice.objects.filter(pk=payload["invoice_id"]).update(paid=True)
        return {"charged": True}

    $ python manage.py orbit_worker --capacity 8

Each handler runs between ``django.db.close_old_connections()`` calls, as Django does around a
request (:class:`CloseOldConnections`). Outside manage.py, ``orbit-sync worker
orbit_sync.contrib.django:make_worker`` calls ``django.setup()`` (``DJANGO_SETTINGS_MODULE`` must
be set). Needs the ``django`` extra: ``pip install 'orbit-sync[django]'``.
"""

from __future__ import annotations

try:
    import django  # noqa: F401
except ImportError as exc:  # say which extra, not only which module
    raise ImportError(
        "orbit_sync.contrib.django needs Django: pip install 'orbit-sync[django]'"
    ) from exc

from ._db import CloseOldConnections
from ._registry import HandlerRegistry, handler, registry
from ._worker import build_worker, discover_handlers, make_worker, setup_django

__all__ = [
    "CloseOldConnections",
    "HandlerRegistry",
    "build_worker",
    "discover_handlers",
    "handler",
    "make_worker",
    "registry",
    "setup_django",
]
