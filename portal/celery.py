"""The Celery app. Workers: `celery -A portal worker`; beat: `celery -A portal beat`.

Task modules are found in each app's tasks.py; the periodic tasks (the tick, accounting,
retention, telemetry roll-ups) are listed by name in settings.CELERY_BEAT_SCHEDULE.
"""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

app = Celery("meridian")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
