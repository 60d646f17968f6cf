from django.core.management.base import BaseCommand
from django.utils import timezone

from jobs.bundles import artifacts_collect


class Command(BaseCommand):
    help = ("Delete code bundles no job references, MERIDIAN_BUNDLE_GRACE_DAYS after their upload, and the saved "
            "outputs of jobs that ended more than MERIDIAN_OUTPUTS_RETENTION_DAYS ago, and the checkpoint stores no "
            "agent removed (what Celery beat runs every MERIDIAN_ARTIFACTS_GC_SECONDS). Never a live job's, nor a "
            "recent one's.")

    def add_arguments(self, parser):
        parser.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")

    def handle(self, *args, **options):
        dry_run = options["dry_run"]
        deleted = artifacts_collect(now=timezone.now(), dry_run=dry_run)
        verb = "would delete" if dry_run else "deleted"
        for item in deleted["bundles"]:
            self.stdout.write(f"{verb} bundle {item}")
        for job_id in deleted["outputs"]:
            self.stdout.write(f"{verb} the saved outputs of job {job_id}")
        for job_id in deleted["stores"]:
            self.stdout.write(f"{verb} the checkpoint store of job {job_id}")
        self.stdout.write(f"{verb} {len(deleted['bundles'])} bundle(s), the outputs of "
                          f"{len(deleted['outputs'])} job(s) and the checkpoint stores of {len(deleted['stores'])}")
