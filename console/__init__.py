"""The Django project (settings, URLs, ASGI, Celery) and the accounts app."""

from .celery import app as celery_app

__all__ = ["celery_app"]
