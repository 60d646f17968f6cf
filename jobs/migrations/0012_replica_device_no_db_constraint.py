# A placement tick's ~110k deferred foreign-key checks of Replica.device (jobs/models.py: Replica).

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('fleet', '0001_initial'),
        ('jobs', '0011_fk_indexes_covered'),
    ]

    operations = [
        migrations.AlterField(
            model_name='replica',
            name='device',
            field=models.ForeignKey(blank=True, db_constraint=False, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='replicas', to='fleet.accelerator'),
        ),
    ]
