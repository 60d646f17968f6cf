import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command

from fleet.models import Accelerator, Cluster, Node, Region
from fleet.selectors import fleet_summary
from fleet.services import fleet_generate


def test_it_generates_regions_clusters_nodes_and_devices(db):
    result = fleet_generate(regions=2, clusters=3, nodes=4, devices=8, accelerator_type="H100-80GB")

    assert (result.regions, result.clusters, result.nodes, result.accelerators) == (2, 6, 24, 192)
    assert (
        Region.objects.count(), Cluster.objects.count(), Node.objects.count(), Accelerator.objects.count()
    ) == (2, 6, 24, 192)
    node = Node.objects.get(hostname="gen-r01-c02-n0003")
    assert sorted(node.accelerators.values_list("index", flat=True)) == list(range(8))
    assert set(Accelerator.objects.values_list("type", "memory_gb")) == {("H100-80GB", 80)}


def test_it_refuses_an_unknown_accelerator_type(db):
    with pytest.raises(ValidationError, match="unknown accelerator type 'H900'"):
        fleet_generate(regions=1, clusters=1, nodes=1, devices=1, accelerator_type="H900")


def test_it_refuses_to_generate_over_existing_regions(db):
    fleet_generate(regions=1, clusters=1, nodes=1, devices=1, accelerator_type="CPU")

    with pytest.raises(ValidationError, match="exist already; pick another --prefix"):
        fleet_generate(regions=1, clusters=1, nodes=1, devices=1, accelerator_type="CPU")
    assert Node.objects.count() == 1


@pytest.mark.parametrize("size", [0, -1])
def test_it_refuses_non_positive_sizes(db, size):
    with pytest.raises(ValidationError, match="--nodes must be a whole number >= 1"):
        fleet_generate(regions=1, clusters=1, nodes=size, devices=1, accelerator_type="CPU")


def test_the_command_prints_what_it_made(db, capsys):
    call_command(
        "fleet_generate", "--regions", "1", "--clusters", "2", "--nodes", "3", "--devices", "4", "--type", "A100-40GB"
    )

    out = capsys.readouterr().out
    assert "24 accelerators" in out
    assert fleet_summary()["totals"]["accelerators"] == 24
