"""manage.py fleet_enrollment_token --cluster REGION/CLUSTER [--hours H] [--note TEXT] | --revoke ID | --list"""
from datetime import timedelta

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from fleet.models import Cluster, EnrollmentToken, Region
from fleet.services import ENROLLMENT_TOKEN_MAX_LIFETIME, enrollment_token_create, enrollment_token_revoke


class Command(BaseCommand):
    help = (
        "Create an enrollment token that lets agents enrol NEW nodes into one cluster until it expires, "
        "and print it (only its hash is stored: this is the only copy). Give it to the agents in "
        "$MERIDIAN_AGENT_ENROLL_TOKEN or a file (--enroll-token-file), never on a command line. "
        "It never takes over an enrolled node."
    )

    def add_arguments(self, parser):
        parser.add_argument("--cluster", help="REGION/CLUSTER the token enrols into (created if new)")
        parser.add_argument("--hours", type=float, default=24.0,
                            help=f"lifetime (default 24; at most {ENROLLMENT_TOKEN_MAX_LIFETIME.days * 24})")
        parser.add_argument("--note", default="", help="what the token is for (shown in the admin)")
        parser.add_argument("--revoke", type=int, metavar="ID", help="revoke the enrollment token with this id")
        parser.add_argument("--list", action="store_true", help="list the enrollment tokens (never their values)")

    def handle(self, *args, **options):
        if options["list"]:
            now = timezone.now()
            for row in EnrollmentToken.objects.select_related("cluster", "cluster__region"):
                status = row.unusable_reason(now) or "usable"
                self.stdout.write(f"{row.pk}\t{row.cluster}\texpires {row.expires_at.isoformat()}\t"
                                  f"{row.nodes_enrolled} node(s)\t{status}\t{row.note}")
            return
        if options["revoke"] is not None:
            row = EnrollmentToken.objects.filter(pk=options["revoke"]).first()
            if row is None:
                raise CommandError(f"no enrollment token with id {options['revoke']}")
            enrollment_token_revoke(token_row=row)
            self.stdout.write(f"revoked enrollment token {row.pk} ({row.cluster})")
            return
        if not options["cluster"] or options["cluster"].count("/") != 1:
            raise CommandError("name the cluster: --cluster REGION/CLUSTER (e.g. --cluster eu-west/c1)")
        region_name, cluster_name = (part.strip() for part in options["cluster"].split("/"))
        if not region_name or not cluster_name:
            raise CommandError("--cluster REGION/CLUSTER: both parts are needed")
        region, _ = Region.objects.get_or_create(name=region_name)
        cluster, _ = Cluster.objects.get_or_create(region=region, name=cluster_name)
        try:
            row, token = enrollment_token_create(cluster=cluster, expires_in=timedelta(hours=options["hours"]),
                                                 note=options["note"], created_by="manage.py")
        except ValidationError as exc:
            raise CommandError(f"--hours: {'; '.join(exc.message_dict['expires_in'])}") from None
        self.stderr.write(f"enrollment token {row.pk} for {cluster}, expires {row.expires_at.isoformat()}:")
        self.stdout.write(token)
