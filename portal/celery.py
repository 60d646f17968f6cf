"""The Celery app. Workers: `celery -A portal worker`; beat: `celery -A portal beat`.

Task modules are found in each app's tasks.py; the periodic tick is named by
settings.MERIDIAN_TICK_TASK (default "jobs.tasks.scheduler_tick") in CELERY_BEAT_SCHEDULE.
"""
import importlib.util
import logging
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

logger = logging.getLogger(__name__)

app = Celery("meridian")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_after_configure.connect
def _drop_tick_until_it_exists(sender, **kwargs):
    """Beat would send the tick every few seconds to workers that cannot run it until the
    control loop's task module exists; leave it out (with a warning) until then."""
    schedule = sender.conf.beat_schedule or {}
    for name, entry in list(schedule.items()):
        module = entry["task"].rsplit(".", 1)[0]
        if importlib.util.find_spec(module.split(".")[0]) and not importlib.util.find_spec(module):
            logger.warning("beat entry %s skipped: task module %s does not exist yet", name, module)
            del schedule[name]
