"""The Django app: add ``"orbit_sync.contrib.django"`` to ``INSTALLED_APPS``."""

from __future__ import annotations

from django.apps import AppConfig


class OrbitSyncConfig(AppConfig):  # type: ignore[misc]  # Django ships no type hints
    """Provides the ``orbit_worker`` management command (no models, no migrations)."""

    name = "orbit_sync.contrib.django"
    label = "orbit_sync"
    verbose_name = "Orbit workers"
