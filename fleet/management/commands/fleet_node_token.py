import json

from django.core.management.base import BaseCommand, CommandError

from fleet.models import Node
from fleet.services import node_token_issue


class Command(BaseCommand):
    help = (
        "Issue (or rotate) node agent tokens and print them as JSON {hostname: token}. "
        "Only the hash is stored; the printed token is the only copy."
    )

    def add_arguments(self, parser):
        parser.add_argument("hostnames", nargs="*")
        parser.add_argument("--region", help="every node in this region")

    def handle(self, *args, **options):
        nodes = Node.objects.all()
        if options["region"]:
            nodes = nodes.filter(cluster__region__name=options["region"])
        if options["hostnames"]:
            nodes = nodes.filter(hostname__in=options["hostnames"])
            missing = sorted(set(options["hostnames"]) - set(nodes.values_list("hostname", flat=True)))
            if missing:
                raise CommandError(f"no such node(s): {', '.join(missing)}")
        elif not options["region"]:
            raise CommandError("name the nodes (hostnames) or a --region")
        self.stdout.write(
            json.dumps({node.hostname: node_token_issue(node=node) for node in nodes.order_by("hostname")})
        )
