from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0008_job_if_resume_refused'),
    ]

    operations = [
        migrations.AddField(
            model_name='checkpoint',
            name='retired_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
