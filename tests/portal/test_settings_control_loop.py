"""The control loop's knobs are read once, in portal/settings.py, into typed settings; a bad value
stops start-up with a message that names the variable. Each case imports portal.settings in a
fresh interpreter (the helpers in test_settings_profiles)."""
import json

import pytest

from tests.portal.test_settings_profiles import settings_with

KNOBS = ("MERIDIAN_MIN_RUN_SECONDS", "MERIDIAN_PREMIUM_RESERVE_DEVICES", "MERIDIAN_JOB_MAX_SPREAD",
         "MERIDIAN_NODE_LOST_AFTER_SECONDS", "MERIDIAN_ACCOUNTING_SECONDS", "MERIDIAN_WORKFLOW_TIMEOUT_SECONDS",
         "MERIDIAN_AGENT_ENROLLMENT_TOKEN", "CELERY_BEAT_SCHEDULE", "MERIDIAN_PACKED_TIERS_MAY_SPREAD")


def test_the_knobs_are_typed_settings_and_feed_the_beat_schedule(tmp_path):
    env = {"MERIDIAN_MIN_RUN_SECONDS": "30", "MERIDIAN_PREMIUM_RESERVE_DEVICES": "2",
           "MERIDIAN_JOB_MAX_SPREAD": "Region", "MERIDIAN_ACCOUNTING_SECONDS": "0",
           "MERIDIAN_AGENT_ENROLLMENT_TOKEN": "t", "MERIDIAN_PACKED_TIERS_MAY_SPREAD": "1"}
    result = settings_with(env, *KNOBS, data_dir=tmp_path)

    seen = json.loads(result.stdout)
    assert (seen["MERIDIAN_MIN_RUN_SECONDS"], seen["MERIDIAN_PREMIUM_RESERVE_DEVICES"]) == (30.0, 2)
    assert seen["MERIDIAN_JOB_MAX_SPREAD"] == "region"
    assert seen["MERIDIAN_PACKED_TIERS_MAY_SPREAD"] is True
    assert (seen["MERIDIAN_NODE_LOST_AFTER_SECONDS"], seen["MERIDIAN_WORKFLOW_TIMEOUT_SECONDS"]) == (30.0, 300.0)
    assert seen["MERIDIAN_AGENT_ENROLLMENT_TOKEN"] == "t"
    assert seen["CELERY_BEAT_SCHEDULE"]["scheduler-tick"]["task"] == "jobs.tasks.scheduler_tick"
    assert seen["CELERY_BEAT_SCHEDULE"]["accounting"]["schedule"] == 1.0  # never more often than once a second


@pytest.mark.parametrize(("name", "value", "says"), [
    ("MERIDIAN_NODE_LOST_AFTER_SECONDS", "soon", "is not a number"),
    ("MERIDIAN_WORKFLOW_TIMEOUT_SECONDS", "-5", "must be 0 or more"),
    ("MERIDIAN_PREMIUM_RESERVE_DEVICES", "1.5", "is not a whole number"),
    ("MERIDIAN_JOB_MAX_SPREAD", "planet", "choose one of node, rack, cluster, region"),
    ("MERIDIAN_PROTECTED_PROGRESS_SHARE", "2", "must be a share between 0 and 1"),
    ("MERIDIAN_PACKED_TIERS_MAY_SPREAD", "yes", "choose one of 0, 1"),
], ids=["not-a-number", "negative", "not-whole", "unknown-choice", "not-a-share", "not-a-flag"])
def test_a_bad_value_stops_start_up_naming_the_variable(tmp_path, name, value, says):
    result = settings_with({name: value}, data_dir=tmp_path)

    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and f"{name}={value!r}" in result.stderr
    assert says in result.stderr
