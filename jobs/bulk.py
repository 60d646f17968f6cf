"""Bulk writes for the tick's big applies: many rows in a constant number of statements.

    rows_update(table, set_sql=..., columns=..., ids=..., types=...)   UPDATE many rows by id (or keys=...)
    RowWrites(set_sql, columns, types)                                  per-row values another UPDATE takes along
    Model.objects.filter(pk__any_of=ids)                                select many rows by id (AnyOf)
    instances_loaded(Model, fields, rows)                               model instances of values_list rows, cheap
    events_insert(events)                                               INSERT many JobEvents
    EventRow(...)                                                       a JobEvent's columns, cheap

Why not the ORM: Django's PostgreSQL backend binds parameters on the client (psycopg's
ClientCursor), so a statement with 60k placeholders, or a list of 100k datetimes, is quoted value
by value in Python. At a first placement of 30k jobs (100k accelerators) the ORM's bulk_create of
~60k events and the quoting of the UPDATE arrays were ~8 s of a ~13 s apply. Here:
  - numbers travel as one array literal (a single quoted string, cast on the server);
  - a value the same for every row (the tick's `now`) is one parameter, not an array;
  - events go in through COPY (PostgreSQL), from plain tuples: no model instances to build.
SQLite (the embedded default) keeps the ORM paths; its writes are local and cheap.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import NamedTuple

from django.db import connection
from django.db.models import Lookup

from jobs.models import JobEvent


def cursor_prepared():
    """Returns a Django cursor whose statements PostgreSQL parses and plans once per connection
    (server-side binding, prepared on first use; psycopg keeps them per connection, and the pool
    keeps the connections), or a plain cursor elsewhere and with MERIDIAN_DB_PREPARED_STATEMENTS=0
    (an external pooler in transaction mode that cannot carry prepared statements, e.g. PgBouncer
    before 1.21). For the submission's fast path (jobs/submit_api.py), whose two statements cost
    PostgreSQL ~0.8-1.2 ms each to parse and plan, more than to run. Django's own cursors bind on
    the client and never prepare, so the connection's threshold touches only these."""
    from django.conf import settings

    if connection.vendor != "postgresql" or not settings.MERIDIAN_DB_PREPARED_STATEMENTS:
        return connection.cursor()
    from django.db.backends.postgresql.base import ServerBindingCursor

    connection.ensure_connection()
    raw = connection.connection
    raw.prepare_threshold = 0
    return connection._prepare_cursor(ServerBindingCursor(raw))


ROWS_UPDATE_CHUNK = 50_000
COPY_MIN_ROWS = 200  # below this many rows or ids, the ORM's own statement is as quick


def int_array_literal(values: Iterable[int | None]) -> str:
    """A PostgreSQL array literal of whole numbers ('{1,NULL,3}'), for a `%s::bigint[]` parameter.
    int() on each value: nothing but digits and a sign can reach the SQL text."""
    return "{" + ",".join("NULL" if v is None else str(int(v)) for v in values) + "}"


class AnyOf(Lookup):
    """`filter(pk__any_of=ids)`: the rows whose column is one of many whole numbers, bound as ONE
    parameter (PostgreSQL: `= ANY(array)`; SQLite: `IN (SELECT value FROM json_each(list))`).
    `pk__in` binds one placeholder per id: ~1 s of client-side quoting at 30k ids on PostgreSQL,
    and SQLite refuses more than ~32k. Registered on every field and foreign key (JobsConfig.ready)."""

    lookup_name = "any_of"
    prepare_rhs = False

    def as_sql(self, compiler, connection):
        lhs, lhs_params = self.process_lhs(compiler, connection)
        if connection.vendor == "postgresql":
            return f"{lhs} = ANY(%s::bigint[])", [*lhs_params, int_array_literal(self.rhs)]
        return f"{lhs} IN (SELECT value FROM json_each(%s))", [*lhs_params, json.dumps([int(v) for v in self.rhs])]


def rows_update(table: str, *, set_sql: str, columns: list[list[int | None]], types: tuple[str, ...],
                ids: list[int] | None = None, keys: Mapping[str, list[int]] | None = None,
                params: Sequence[object] = (), where_sql: str = "", where_params: Sequence[object] = ()) -> int:
    """UPDATE `table` SET `set_sql` for the rows `ids`, row i taking columns[k][i] as v.c<k+1>;
    returns how many rows were updated.

    `keys` instead of `ids` names the rows by other columns, a unique key of whole numbers:
    row i is the one whose column c equals keys[c][i] for every c (e.g. {"job_id": [...],
    "rank": [...]}), so a caller that knows the key need not read the ids first.
    `columns` hold whole numbers or None (NULL), of the SQL `types`. `params` fill the `%s`
    placeholders of `set_sql`: values the same for every row (e.g. the tick's now). `where_sql`
    (with `where_params` for its `%s`) is a further condition on each row, e.g. "state = %s" for
    a conditional update; it may not use v.cN. Column names in both are the table's own (no
    prefix): the row's current values.

    PostgreSQL: one UPDATE ... FROM unnest(arrays) per ROWS_UPDATE_CHUNK rows, each array one
    literal. Other databases: an executemany of one-row UPDATEs.
    """
    if (ids is None) == (keys is None):
        raise TypeError("rows_update takes either ids or keys")
    keys = {"id": ids} if keys is None else dict(keys)
    key_names = list(keys)
    key_values = [keys[name] for name in key_names]
    count = len(key_values[0])
    if not count:
        return 0
    names = [f"c{k + 1}" for k in range(len(columns))]
    condition = f" AND ({where_sql})" if where_sql else ""
    updated = 0
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            arrays = ", ".join(f"%s::{t}[]" for t in ("bigint",) * len(key_names) + tuple(types))
            match = " AND ".join(f"{table}.{name} = v.{name}" for name in key_names)
            sql = (f"UPDATE {table} SET {set_sql} FROM unnest({arrays}) AS v({', '.join([*key_names, *names])}) "
                   f"WHERE {match}{condition}")
            for start in range(0, count, ROWS_UPDATE_CHUNK):
                end = start + ROWS_UPDATE_CHUNK
                cursor.execute(sql, [*params, *(int_array_literal(c[start:end]) for c in (*key_values, *columns)),
                                     *where_params])
                updated += cursor.rowcount
        else:
            # One %s per placeholder, in the order they appear: set_sql's own %s (params, in
            # turn) and each v.cN (the row's value).
            found = [(m.start(), None) for m in re.finditer(r"%s", set_sql)]
            found += [(m.start(), int(m.group(1)) - 1) for m in re.finditer(r"\bv\.c(\d+)\b", set_sql)]
            order = [k for _, k in sorted(found)]
            assignments = re.sub(r"\bv\.c\d+\b", "%s", set_sql)
            match = " AND ".join(f"{name} = %s" for name in key_names)
            rows = []
            for i in range(count):
                own = iter(params)
                rows.append(tuple(next(own) if k is None else columns[k][i] for k in order)
                            + tuple(values[i] for values in key_values) + tuple(where_params))
            cursor.executemany(f"UPDATE {table} SET {assignments} WHERE {match}{condition}", rows)
            updated = cursor.rowcount
    return updated


def instances_loaded(model, field_names: Sequence[str], rows: Iterable[Sequence[object]]) -> list:
    """Returns an instance of `model` per row of `rows` (the values of the attnames `field_names`,
    in that order, as values_list returns them), as the ORM's own loading (Model.from_db) makes
    them: saved rows of the connection's database, the other fields deferred (loaded on access).

    For thousands of rows at once: from_db runs Model.__init__ over every field of the model
    (~40 of a Job, ~30 µs a row: ~1 s of a placement of 30k jobs); this sets the loaded ones only.
    ValueError names a field that is not one of the model's attnames. Falls back to from_db when
    anything listens to the model's pre_init / post_init signals (they would be skipped)."""
    from django.db.models.base import ModelState
    from django.db.models.signals import post_init, pre_init

    field_names = tuple(field_names)
    unknown = set(field_names) - {field.attname for field in model._meta.concrete_fields}
    if unknown:
        raise ValueError(f"{model.__name__} has no field {sorted(unknown)} (attnames: team_id, not team)")
    if pre_init.has_listeners(model) or post_init.has_listeners(model):
        return [model.from_db(connection.alias, field_names, row) for row in rows]
    instances = []
    for row in rows:
        instance = model.__new__(model)
        state = instance._state = ModelState()
        state.adding, state.db = False, connection.alias
        instance.__dict__.update(zip(field_names, row))
        instances.append(instance)
    return instances


class RowWrites(NamedTuple):
    """Per-row values a bulk UPDATE writes besides its own, in the same statement (rows_update's
    `set_sql` / `columns` / `types`): e.g. a start's device_count and region with its state change,
    so that each job row is written once, not twice."""

    set_sql: str  # "device_count = v.c1, region_id = v.c2, generation = generation + 1"
    columns: list[list[int | None]]  # columns[k][i]: v.c<k+1> of the i-th row (the caller's order)
    types: tuple[str, ...]  # each column's SQL type ("integer", "bigint")

    def assigned(self) -> set[str]:
        """Returns the columns `set_sql` assigns."""
        return set(re.findall(r"(?:^|,)\s*(\w+)\s*=", self.set_sql))


class EventRow(NamedTuple):
    """One JobEvent's columns, without a model instance (60k instances cost ~1 s to build)."""

    job_id: int
    type: str
    reason: str = ""
    extra_data: dict | None = None
    created_at: datetime | None = None
    from_state: str = ""
    to_state: str = ""
    actor_id: int | None = None


_COPY_COLUMNS = ("job_id", "type", "from_state", "to_state", "reason", "actor_id", "extra_data", "created_at")


def events_insert(events: Sequence[JobEvent | EventRow], *, now: datetime) -> None:
    """Writes `events` (model instances or EventRows; created_at None -> `now`) in bulk.

    PostgreSQL, COPY_MIN_ROWS or more: one COPY. Otherwise bulk_create. The reason is cut to the
    column's 500 characters either way (the ORM would refuse it at the database)."""
    if not events:
        return
    if connection.vendor == "postgresql" and len(events) >= COPY_MIN_ROWS:
        table = JobEvent._meta.db_table
        with connection.cursor() as cursor:
            with cursor.cursor.copy(f"COPY {table} ({', '.join(_COPY_COLUMNS)}) FROM STDIN") as copy:
                for event in events:  # a JobEvent and an EventRow have the same attribute names
                    copy.write_row((event.job_id, event.type, event.from_state, event.to_state, event.reason[:500],
                                    event.actor_id, json.dumps(event.extra_data or {}),
                                    event.created_at or now))
        return
    JobEvent.objects.bulk_create([
        event if isinstance(event, JobEvent) else JobEvent(
            job_id=event.job_id, type=event.type, from_state=event.from_state, to_state=event.to_state,
            reason=event.reason[:500], actor_id=event.actor_id, extra_data=event.extra_data or {},
            created_at=event.created_at or now)
        for event in events], batch_size=2000)
