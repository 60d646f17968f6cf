from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from fleet.accelerator_types import ACCELERATOR_TYPES
from fleet.services import fleet_generate


class Command(BaseCommand):
    help = (
        "Generate a synthetic fleet with bulk inserts, e.g. the planet-scale one: "
        "--regions 4 --clusters 8 --nodes 400 --devices 8 --type H100-80GB (102,400 accelerators). "
        "--clusters is per region, --nodes per cluster, --devices per node."
    )

    def add_arguments(self, parser):
        parser.add_argument("--regions", type=int, default=4)
        parser.add_argument("--clusters", type=int, default=8, help="clusters per region")
        parser.add_argument("--nodes", type=int, default=400, help="nodes per cluster")
        parser.add_argument("--devices", type=int, default=8, help="accelerators per node")
        parser.add_argument("--type", default="H100-80GB", help=f"one of {', '.join(ACCELERATOR_TYPES)}")
        parser.add_argument("--prefix", default="gen", help="name prefix for regions and hosts")

    def handle(self, *args, **options):
        total = options["regions"] * options["clusters"] * options["nodes"] * options["devices"]

        def progress(done):
            if options["verbosity"] >= 2:
                self.stdout.write(f"  {done}/{total} accelerators")

        try:
            result = fleet_generate(
                regions=options["regions"],
                clusters=options["clusters"],
                nodes=options["nodes"],
                devices=options["devices"],
                accelerator_type=options["type"],
                prefix=options["prefix"],
                progress=progress,
            )
        except ValidationError as error:
            raise CommandError(" ".join(error.messages)) from error
        self.stdout.write(
            f"Generated {result.regions} regions, {result.clusters} clusters, {result.nodes} nodes, "
            f"{result.accelerators} accelerators in {result.seconds:.2f} s"
        )
