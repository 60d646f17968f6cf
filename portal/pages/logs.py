"""The job page's log parts: what the live tail starts from, and a failed job's failing rank."""
from jobs.logs import log_failing_rank, log_tail_text
from jobs.models import Job


def job_log_context(job) -> dict:
    """Returns the template context of the job page's log card: the ranks to choose from and,
    for a failed job, the rank that failed it with the tail of its log."""
    context = {"log_ranks": list(range(job.world_size)), "failure_rank": None, "failure_tail": ""}
    if job.state == Job.State.FAILED:
        rank = log_failing_rank(job=job)
        context["failure_rank"] = rank
        if rank is not None:
            context["failure_tail"] = log_tail_text(job=job, rank=rank, lines=40)
    return context
