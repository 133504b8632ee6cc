"""The Celery application: commands to each host's engine travel on that host's queue."""

from __future__ import annotations

import os

from celery import Celery

from . import broker  # noqa: F401 - registers the embedded broker's "fyfs://" scheme

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

app = Celery("forkyard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["sandboxes", "billing"])
