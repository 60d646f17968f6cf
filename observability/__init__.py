"""Meridian's Prometheus metrics (observability.metrics), shared by the web processes and the
Celery workers. Django-free: every app may import it (fleet, jobs, portal)."""
