import json

import pytest
from django.core.management import CommandError, call_command

from fleet.models import Accelerator, Node, Region
from fleet.services import fleet_load

DESCRIPTION = {
    "regions": [
        {
            "name": "east",
            "clusters": [
                {
                    "name": "c0",
                    "nodes": [
                        {
                            "hostname": "n0", "rack": "r0", "nvlink_domain": "d0",
                            "accelerators": {"type": "H100-80GB", "count": 8},
                        },
                        {
                            "hostname": "n1",
                            "accelerators": [{"type": "A100-40GB"}, {"type": "A100-40GB", "memory_gb": 40}],
                        },
                    ],
                }
            ],
        }
    ]
}


def test_it_loads_regions_clusters_nodes_and_devices(db):
    result = fleet_load(description=DESCRIPTION)

    assert (result.regions, result.clusters, result.nodes, result.accelerators) == (1, 1, 2, 10)
    n0 = Node.objects.get(hostname="n0")
    assert (n0.cluster.region.name, n0.rack, n0.nvlink_domain) == ("east", "r0", "d0")
    assert list(n0.accelerators.values_list("index", "type", "memory_gb")) == [(i, "H100-80GB", 80) for i in range(8)]


def test_loading_twice_creates_nothing_new(db):
    fleet_load(description=DESCRIPTION)

    again = fleet_load(description=DESCRIPTION)

    assert (again.regions, again.clusters, again.nodes, again.accelerators) == (0, 0, 0, 0)
    assert Accelerator.objects.count() == 10


@pytest.mark.parametrize(
    ("description", "message"),
    [
        ({"nodes": []}, 'a fleet description is an object with a "regions" list'),
        ({"regions": [{"clusters": []}]}, "regions[0]: needs a 'name'"),
        (
            {"regions": [{"name": "e", "clusters": [
                {"name": "c", "nodes": [{"hostname": "h", "accelerators": {"type": "TPU", "count": 1}}]}
            ]}]},
            "regions[0].clusters[0].nodes[0].accelerators[0]: unknown accelerator type 'TPU'",
        ),
        (
            {"regions": [{"name": "e", "clusters": [
                {"name": "c", "nodes": [{"hostname": "h", "accelerators": {"type": "CPU", "count": -1}}]}
            ]}]},
            "nodes[0].accelerators.count: must be a whole number >= 0",
        ),
    ],
    ids=["no-regions", "region-without-name", "unknown-type", "negative-count"],
)
def test_a_bad_description_names_the_path_and_loads_nothing(db, description, message):
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError) as error:
        fleet_load(description=description)
    assert message in " ".join(error.value.messages)
    assert not Region.objects.exists()


def test_a_hostname_in_another_cluster_is_refused(db):
    fleet_load(description=DESCRIPTION)
    moved = json.loads(json.dumps(DESCRIPTION))
    moved["regions"][0]["clusters"][0]["name"] = "c9"

    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError, match="hostname 'n0' already belongs to cluster east/c0"):
        fleet_load(description=moved)


def test_the_command_loads_yaml_and_json(db, tmp_path, capsys):
    json_path = tmp_path / "fleet.json"
    json_path.write_text(json.dumps(DESCRIPTION))

    call_command("fleet_load", str(json_path))
    call_command("fleet_load", "fleet/fixtures/demo_fleet.yaml")

    out = capsys.readouterr().out
    assert "10 accelerators" in out and "16 accelerators" in out
    assert Node.objects.count() == 6


def test_the_command_reports_a_bad_file_clearly(db, tmp_path):
    bad = tmp_path / "fleet.yaml"
    bad.write_text("regions: [unclosed")

    with pytest.raises(CommandError, match="not valid YAML"):
        call_command("fleet_load", str(bad))
    with pytest.raises(CommandError, match="no such file"):
        call_command("fleet_load", str(tmp_path / "missing.yaml"))
