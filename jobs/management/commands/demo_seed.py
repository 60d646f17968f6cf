from pathlib import Path

from django.core.management.base import BaseCommand

from fleet.models import Region
from fleet.services import fleet_generate, fleet_load
from jobs.demo_cast import cast_create

DEMO_FLEET = Path(__file__).resolve().parents[3] / "fleet" / "fixtures" / "demo_fleet.yaml"


class Command(BaseCommand):
    help = (
        "Seed the demo: users alice, bob, charlie, carol, admin (passwords in the README; "
        "local demo only), teams A and B with quotas, and the embedded CPU fleet "
        "(2 regions × 2 clusters). Idempotent."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--synthetic-fleet", action="store_true",
            help="also generate a 2 × 4 × 32 × 8 = 2,048 H100 fleet (no agents) for the heatmap",
        )

    def handle(self, *args, **options):
        import yaml

        cast_create()
        result = fleet_load(description=yaml.safe_load(DEMO_FLEET.read_text()))
        self.stdout.write(
            f"demo users and teams ready; CPU demo fleet: +{result.nodes} nodes, +{result.accelerators} devices"
        )
        if options["synthetic_fleet"] and not Region.objects.filter(name="synth-r00").exists():
            generated = fleet_generate(
                regions=2, clusters=4, nodes=32, devices=8, accelerator_type="H100-80GB", prefix="synth"
            )
            self.stdout.write(f"synthetic fleet: {generated.accelerators} H100-80GB in {generated.seconds:.1f} s")
