"""A database too busy to answer (SQLite's write lock held past its timeout, no free pooled
PostgreSQL connection) is load, not a bug: the API answers 503 with Retry-After, not a 500."""
import sqlite3

from django.db import OperationalError


def real_lock_error(tmp_path) -> str:
    """The message SQLite itself gives a writer that waited out its timeout on a held lock."""
    path = tmp_path / "locked.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("create table t (x)")
    holder.execute("begin exclusive")
    waiter = sqlite3.connect(path, timeout=0.01)
    try:
        waiter.execute("insert into t values (1)")
    except sqlite3.OperationalError as exc:
        return str(exc)
    finally:
        waiter.close()
        holder.close()
    raise AssertionError("the second writer was not refused")


def handled(exc):
    import rest_framework.views  # noqa: F401 (first, as in the server: its settings import portal.api_errors)

    from portal.api_errors import exception_handler

    return exception_handler(exc, {})


def test_a_locked_database_is_a_503_with_retry_after(tmp_path):
    response = handled(OperationalError(real_lock_error(tmp_path)))
    from portal.api_errors import RETRY_AFTER_S

    assert response.status_code == 503
    assert response["Retry-After"] == str(RETRY_AFTER_S)
    assert "busy" in response.data["detail"] and "retry" in response.data["detail"]


def test_an_exhausted_connection_pool_is_a_503():
    # psycopg_pool.PoolTimeout's message, as Django re-raises it
    response = handled(OperationalError("couldn't get a connection after 30.00 sec"))
    assert response.status_code == 503


def test_other_database_errors_stay_500s():
    response = handled(OperationalError("no such table: jobs_job"))
    assert response.status_code == 500
    assert "no such table" not in response.data["detail"]
