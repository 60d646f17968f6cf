"""The Django project: settings, URLs, ASGI/WSGI, the Celery app, authentication."""
from .celery import app as celery_app

__all__ = ["celery_app"]
