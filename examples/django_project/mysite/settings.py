"""Settings of the example project: SQLite, the billing app, and the Orbit worker app.

The Orbit server comes from the environment ($ORBIT_URL, $ORBIT_TOKEN, $ORBIT_QUEUE_ID), as
``orbit-sync mock-server`` prints it; ORBIT_SYNC below only sets what the environment does not.
"""

from __future__ import annotations

import os
from pathlib import Path

import django

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "example-only-not-secret"
DEBUG = False
ALLOWED_HOSTS: list[str] = []
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "orbit_sync.contrib.django",  # manage.py orbit_worker
    "billing",  # billing/orbit_tasks.py declares the handlers
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("EXAMPLE_DB", str(BASE_DIR / "db.sqlite3")),
        # Django's default: a connection lives for one task (closed after it by the worker).
        "CONN_MAX_AGE": 0,
        "OPTIONS": {"timeout": 20},
    }
}
if django.VERSION >= (5, 1):
    # Several worker threads write at once: a transaction that starts as a reader and then
    # writes can fail at once with "database is locked" (SQLite cannot wait for the other
    # writer without a deadlock); taking the write lock at BEGIN makes it wait instead.
    DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"

ORBIT_SYNC = {
    "CAPACITY": 4,
    "DRAIN_TIMEOUT": 30,
}
