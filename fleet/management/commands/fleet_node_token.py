import json

from django.core.management.base import BaseCommand, CommandError

from fleet.models import Node
from fleet.services import node_enrollment_allow, node_token_issue


class Command(BaseCommand):
    help = (
        "Issue (or rotate) node agent tokens and print them as JSON {hostname: token}. "
        "Only the hash is stored; the printed token is the only copy. This is how an enrolled node is "
        "re-enrolled (an enrollment token never takes one over); --allow-enrollment instead revokes the "
        "node's token and lets the next agent with a valid enrollment token for its cluster enrol as it."
    )

    def add_arguments(self, parser):
        parser.add_argument("hostnames", nargs="*")
        parser.add_argument("--region", help="every node in this region")
        parser.add_argument("--allow-enrollment", action="store_true",
                            help="revoke the tokens and let the nodes enrol again (prints their hostnames)")

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
        if options["allow_enrollment"]:
            for node in nodes.order_by("hostname"):
                node_enrollment_allow(node=node)
                self.stdout.write(f"{node.hostname}: token revoked; it may enrol again")
            return
        self.stdout.write(
            json.dumps({node.hostname: node_token_issue(node=node) for node in nodes.order_by("hostname")})
        )
