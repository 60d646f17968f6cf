"""Issue 15: every number from a node is checked against physics. A job's speed reported before
that (steps_per_s: Infinity, 1e300) made the job API a 500 for the whole team; it is forgotten
here (the next report says it again). Checkpoint.sha256 now holds the sha256 of the checkpoint's
MANIFEST.json (required in every report, checked by every restore): no schema change."""
from django.db import migrations, models

MAX_STEPS_PER_S = 1e7  # protocol.node.MAX_STEPS_PER_S when this was written


def unphysical_speeds_forgotten(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    Job.objects.filter(models.Q(steps_per_second__gt=MAX_STEPS_PER_S) | models.Q(steps_per_second__lt=0.0)).update(
        steps_per_second=None)


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0003_moves"),
    ]

    operations = [
        migrations.RunPython(unphysical_speeds_forgotten, migrations.RunPython.noop),
    ]
