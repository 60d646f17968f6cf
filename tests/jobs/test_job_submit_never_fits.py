"""Issue 16: a job that can never fit the fleet is refused at submission through the REST API
(400 naming the bound), by the same rule the simulator uses to reject it on arrival: the fewest
devices it can ever start on (its elastic floor; W for a Premium job, which starts only at its
full size) above the most devices of its type one region holds (MERIDIAN_JOB_MAX_SPREAD=region;
scheduler/sim/engine.py `_admission`)."""
import numpy as np
import pytest
from rest_framework.test import APIClient

from jobs.models import Job
from jobs.snapshot import TIERS
from scheduler.sim import fleet as sim_fleet
from scheduler.sim.baselines import Fifo
from scheduler.sim.engine import Engine
from scheduler.sim.meridian import Meridian
from scheduler.sim.trace import make_trace

JOBS = "/api/jobs/"


@pytest.fixture
def two_regions(db, settings):
    """Two regions of one 4-CPU node each: one job holds at most 4 devices (it never spans regions)."""
    from fleet.services import fleet_generate

    settings.MERIDIAN_JOB_MAX_SPREAD = "region"
    settings.MERIDIAN_MAX_RANKS_PER_DEVICE = 4
    fleet_generate(regions=2, clusters=1, nodes=1, devices=4, accelerator_type="CPU", prefix="fits")


def post(user, spec):
    client = APIClient()
    client.force_authenticate(user)
    return client.post(JOBS, spec, format="json")


def test_a_job_whose_floor_exceeds_every_region_is_refused_with_the_bound(alice, job_spec, two_regions):
    response = post(alice, job_spec(world_size=8, min_devices=8))

    assert response.status_code == 400, response.content
    message = response.json()["min_devices"][0]
    assert "at most 4 CPU device(s) in one region" in message and "could never start" in message
    assert not Job.objects.exists()


def test_a_job_that_fits_one_region_spliced_is_accepted(alice, job_spec, two_regions):
    # W=8 on 2..4 devices of one region (at most 4 ranks per device): it can run.
    assert post(alice, job_spec(world_size=8, min_devices=2)).status_code == 201


def test_a_premium_job_wider_than_every_region_is_refused_though_its_floor_fits(alice, job_spec, two_regions):
    # Premium starts only on all W devices at once (PolicySettings.full_size_tiers): W=8 could
    # never start where one region holds 4, and used to wait forever, pending with a reason.
    response = post(alice, job_spec(tier="premium", world_size=8, min_devices=2))

    assert response.status_code == 400, response.content
    message = response.json()["world_size"][0]
    assert "premium job" in message and "at most 4 CPU device(s) in one region" in message
    assert "Lower world_size to 4 or less, or submit it as standard or basic" in message
    assert not Job.objects.exists()
    # the same job as standard starts on 2 devices and grows: accepted
    assert post(alice, job_spec(tier="standard", world_size=8, min_devices=2)).status_code == 201
    assert post(alice, job_spec(tier="premium", world_size=4, min_devices=2)).status_code == 201


@pytest.mark.parametrize("tier", ["standard", "premium"])
@pytest.mark.parametrize("world_size, min_devices", [(8, 8), (8, 2), (4, 4), (16, 4), (4, 1)])
def test_the_api_and_the_simulator_refuse_the_same_jobs(alice, job_spec, two_regions, world_size, min_devices, tier):
    spec = job_spec(world_size=world_size, min_devices=min_devices, tier=tier)
    accepted = post(alice, spec).status_code == 201
    fleet = sim_fleet.Fleet(name="two-regions", node_devices=np.array([4, 4], np.int32),
                            node_rack=np.array([0, 1], np.int32), node_cluster=np.array([0, 1], np.int32),
                            node_region=np.array([0, 1], np.int32), accelerator="CPU")
    trace = make_trace("one", [0.0], [60.0], [world_size], [0], ["t"], seed=0, tier=[TIERS[tier]])
    trace = trace.__class__(**{**trace.__dict__, "min_devices": np.array([min_devices], np.int32)})
    meridian = Engine(trace, fleet, Meridian())  # elastic: its floor must fit
    fifo = Engine(trace, fleet, Fifo())  # full size only: W must fit
    assert (not meridian.rejected[0]) is accepted
    assert bool(fifo.rejected[0]) is (world_size > 4)
