"""The Celery application: commands to each host's engine travel on that host's queue."""

from __future__ import annotations

import os

from celery import Celery

from . import broker  # noqa: F401 - registers the embedded broker's "fyfs://" scheme

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

app = Celery("forkyard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["sandboxes", "billing", "grading"])
# Periodic work (run by the beat of each host's bulk worker, `celery worker -B`): kept content past its days.
app.conf.beat_schedule = {
    "purge-retained-content": {"task": "grading.tasks.purge_retained_content", "schedule": 3600.0, "options": {"expires": 3000}},
}
