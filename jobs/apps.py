from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self):
        from django.db.models import Field, ForeignObject

        from jobs.bulk import AnyOf

        # filter(pk__any_of=ids), filter(job_id__any_of=ids): many ids as one parameter.
        # Foreign keys take only the lookups registered on ForeignObject and below.
        Field.register_lookup(AnyOf)
        ForeignObject.register_lookup(AnyOf)
