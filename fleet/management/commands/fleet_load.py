import json
from pathlib import Path

import yaml
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from fleet.services import fleet_load


class Command(BaseCommand):
    help = (
        "Load a fleet from a YAML or JSON description: "
        '{"regions": [{"name", "clusters": [{"name", "nodes": [{"hostname", "rack", "nvlink_domain", '
        '"accelerators": {"type": "H100-80GB", "count": 8}}]}]}]}. Existing rows are kept (idempotent).'
    )

    def add_arguments(self, parser):
        parser.add_argument("path", help="a .yaml, .yml or .json file")

    def handle(self, *args, **options):
        path = Path(options["path"])
        if not path.is_file():
            raise CommandError(f"{path}: no such file")
        text = path.read_text()
        try:
            description = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as error:
            raise CommandError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {error}") from error
        try:
            result = fleet_load(description=description)
        except ValidationError as error:
            raise CommandError(f"{path}: " + " ".join(error.messages)) from error
        self.stdout.write(
            f"Loaded {path}: created {result.regions} regions, {result.clusters} clusters, "
            f"{result.nodes} nodes, {result.accelerators} accelerators in {result.seconds:.2f} s"
        )
