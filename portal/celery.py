"""The Celery app. Workers: `celery -A portal worker`; beat: `celery -A portal beat`.

Task modules are found in each app's tasks.py; the periodic tick is named by
settings.MERIDIAN_TICK_TASK (default "jobs.tasks.scheduler_tick") in CELERY_BEAT_SCHEDULE.
"""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

app = Celery("meridian")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
