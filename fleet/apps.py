from django.apps import AppConfig
from django.core import checks


class FleetConfig(AppConfig):
    name = "fleet"
    verbose_name = "Fleet"

    def ready(self):
        checks.register(lease_settings_checked)


def lease_settings_checked(app_configs=None, **kwargs):
    """A warning when the lost-node threshold is too short for the lease flush (fleet.leases)."""
    from django.conf import settings

    from fleet.leases import lease_settings_check

    problem = lease_settings_check(lost_after=settings.MERIDIAN_NODE_LOST_AFTER_SECONDS,
                                   heartbeat=settings.MERIDIAN_AGENT_HEARTBEAT_SECONDS,
                                   flush=settings.MERIDIAN_LEASE_FLUSH_SECONDS)
    return [checks.Warning(problem, id="fleet.W001")] if problem else []
