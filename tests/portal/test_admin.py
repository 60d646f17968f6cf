"""Every model has an admin, and its list and change pages render."""
import pytest
from django.apps import apps
from django.contrib import admin

from fleet.services import fleet_generate
from jobs.services import preemption_request_create

MODELS = [m for app in ("fleet", "jobs") for m in apps.get_app_config(app).get_models()]


@pytest.mark.parametrize("model", MODELS, ids=[m.__name__ for m in MODELS])
def test_every_model_is_registered(model):
    assert admin.site.is_registered(model), f"{model.__name__} has no admin"


@pytest.mark.parametrize("model", MODELS, ids=[m.__name__ for m in MODELS])
def test_the_admin_pages_render(client, admin_user, submit, team_a, alice, model):
    fleet_generate(regions=1, clusters=1, nodes=1, devices=2, accelerator_type="CPU")
    job = submit(team_a, alice)
    preemption_request_create(job=job, reason="test", lost_work_seconds=1)
    client.force_login(admin_user)
    opts = model._meta

    assert client.get(f"/admin/{opts.app_label}/{opts.model_name}/").status_code == 200
    obj = model.objects.first()
    if obj is not None:
        assert client.get(f"/admin/{opts.app_label}/{opts.model_name}/{obj.pk}/change/").status_code == 200
