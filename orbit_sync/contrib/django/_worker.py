"""Build the Worker of a Django project: set Django up, import the apps' handlers, read settings.

Settings, all optional, in ``settings.ORBIT_SYNC`` (each falls back to the environment)::

    ORBIT_SYNC = {
        "URL": "wss://orbit.example.com",     # else $ORBIT_URL
        "TOKEN_FILE": "/run/secrets/orbit",   # or "TOKEN"; else $ORBIT_TOKEN / $ORBIT_TOKEN_FILE
        "QUEUE_ID": "0123...",                # else $ORBIT_QUEUE_ID
        "CAPACITY": 8,
        "DRAIN_TIMEOUT": 30,
        "TIME_LIMIT": 600,                    # seconds per handler run; default: none
        "TASK_MODULE": "orbit_tasks",         # imported from every installed app; None: none
        "TASK_MODULES": ["billing.jobs"],     # more modules to import
        "WORKER_OPTIONS": {"cancel_grace": 5},  # any other Worker keyword argument
    }
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

import django
from django.core.exceptions import ImproperlyConfigured

from ...client import Client, read_token_file, set_token_source
from ...worker import Worker
from ._db import CloseOldConnections
from ._registry import registry

__all__ = ["build_worker", "discover_handlers", "make_worker", "setup_django"]

_KEYS = frozenset(
    {
        "URL",
        "TOKEN",
        "TOKEN_FILE",
        "QUEUE_ID",
        "CAPACITY",
        "DRAIN_TIMEOUT",
        "TIME_LIMIT",
        "TASK_MODULE",
        "TASK_MODULES",
        "WORKER_OPTIONS",
    }
)


def setup_django() -> None:
    """``django.setup()`` unless it already ran (manage.py does it; a plain process does not)."""
    from django.apps import apps
    from django.conf import settings

    if apps.ready:
        return
    if not settings.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        raise ImproperlyConfigured(
            "set DJANGO_SETTINGS_MODULE (e.g. mysite.settings) to run an Orbit worker for a"
            " Django project outside manage.py"
        )
    django.setup()


def orbit_settings() -> Mapping[str, Any]:
    """``settings.ORBIT_SYNC``, checked for unknown keys (a typo would be silently ignored)."""
    from django.conf import settings

    conf = getattr(settings, "ORBIT_SYNC", {})
    if not isinstance(conf, Mapping):
        raise ImproperlyConfigured("settings.ORBIT_SYNC must be a dict")
    unknown = sorted(set(conf) - _KEYS)
    if unknown:
        raise ImproperlyConfigured(
            f"unknown ORBIT_SYNC setting(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}"
        )
    return conf


def discover_handlers() -> list[str]:
    """Import ``<app>.<TASK_MODULE>`` of every installed app that has one, then TASK_MODULES;
    return the names of the modules imported. An error inside one of them propagates."""
    from django.apps import apps

    conf = orbit_settings()
    name = conf.get("TASK_MODULE", "orbit_tasks")
    imported: list[str] = []
    if name:
        for app in apps.get_app_configs():
            module = f"{app.name}.{name}"
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name != module:  # the module exists and one of its imports is missing
                    raise
                continue
            imported.append(module)
    for module in conf.get("TASK_MODULES", ()):
        importlib.import_module(module)
        imported.append(module)
    return imported


def build_worker(
    *,
    url: str | None = None,
    token: str | None = None,
    queue_id: str | None = None,
    capacity: int | None = None,
    drain_timeout: float | None = None,
    time_limit: float | None = None,
) -> Worker:
    """A Worker with every handler declared with ``@handler``, configured from the arguments,
    then ``settings.ORBIT_SYNC``, then the environment; its handlers run between
    ``close_old_connections()`` calls (:class:`CloseOldConnections`)."""
    conf = orbit_settings()
    env = os.environ
    url = url or conf.get("URL") or env.get("ORBIT_URL")
    if not url:
        raise ImproperlyConfigured("no Orbit server: set ORBIT_SYNC['URL'] or $ORBIT_URL")
    # Where the token came from, named if the server refuses it (never the token itself).
    source = "the token given to build_worker()"
    if token is None:
        token, source = conf.get("TOKEN"), "ORBIT_SYNC['TOKEN']"
    if token is None and conf.get("TOKEN_FILE"):
        token = read_token_file(conf["TOKEN_FILE"])
        source = f"ORBIT_SYNC['TOKEN_FILE'] ({conf['TOKEN_FILE']})"
    if token is None:
        token, source = env.get("ORBIT_TOKEN") or None, "$ORBIT_TOKEN"
    if token is None and env.get("ORBIT_TOKEN_FILE"):
        token = read_token_file(env["ORBIT_TOKEN_FILE"])
        source = f"$ORBIT_TOKEN_FILE ({env['ORBIT_TOKEN_FILE']})"
    if token is None:
        raise ImproperlyConfigured(
            "no Orbit token: set ORBIT_SYNC['TOKEN_FILE'], $ORBIT_TOKEN or $ORBIT_TOKEN_FILE"
        )
    queue_id = queue_id or conf.get("QUEUE_ID") or env.get("ORBIT_QUEUE_ID")
    if not queue_id:
        raise ImproperlyConfigured("no queue: set ORBIT_SYNC['QUEUE_ID'] or $ORBIT_QUEUE_ID")
    if not registry.keys():
        raise ImproperlyConfigured(
            "no Orbit handlers: declare them with @orbit_sync.contrib.django.handler(...) in an"
            " installed app's orbit_tasks.py (or list modules in ORBIT_SYNC['TASK_MODULES'])"
        )
    options: dict[str, Any] = dict(conf.get("WORKER_OPTIONS", {}))
    listeners = [CloseOldConnections(), *options.pop("listeners", ())]
    client = Client(url, token)
    set_token_source(client, source)
    worker = Worker(
        client,
        queue_id=queue_id,
        capacity=capacity if capacity is not None else conf.get("CAPACITY", 8),
        drain_timeout=drain_timeout if drain_timeout is not None else conf.get("DRAIN_TIMEOUT", 30),
        time_limit=time_limit if time_limit is not None else conf.get("TIME_LIMIT"),
        listeners=listeners,
        **options,
    )
    registry.apply(worker)
    return worker


def make_worker() -> Worker:
    """Set Django up, import the apps' handler modules and build the Worker: the factory for
    ``DJANGO_SETTINGS_MODULE=mysite.settings orbit-sync worker
    orbit_sync.contrib.django:make_worker``."""
    setup_django()
    discover_handlers()
    return build_worker()
