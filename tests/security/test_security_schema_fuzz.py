"""CI from issue 15 on: a schemathesis pass over the generated OpenAPI schema (every user-facing
operation as a member and as a capacity manager; the agent API as a node, with a node token),
with a bounded, derandomized number of examples: zero 5xx, every status code documented, every
body as its schema says.

The requests go to Django's WSGI application in this process (schemathesis' WSGI transport), so
they see the test's database: the cast, a small fleet, a job of each team. Run time on the 2-core
development machine: see the note in docs/operator-guide.md (about a minute)."""
import hypothesis
import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from rest_framework.authtoken.models import Token
from schemathesis import checks as core_checks
from schemathesis.specs.openapi import checks as openapi_checks

EXAMPLES_PER_OPERATION = 20


@pytest.fixture(autouse=True)
def _connections_kept_open():
    """The WSGI application closes the database connection when a request ends (Django's
    close_old_connections); inside a test's transaction that loses the test database on
    PostgreSQL. Django's own test client disconnects the same signals; so does this."""
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)
CHECKS = [
    core_checks.not_a_server_error,
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance,
    openapi_checks.response_headers_conformance,
    openapi_checks.ignored_auth,  # the same call without credentials is refused
]
# Not negative_data_rejection: an empty query parameter (?tier=) means "not given", as a form sends
# it, and DRF ignores a page_size it cannot read; both are accepted on purpose, which OpenAPI cannot say.


@pytest.fixture
def fuzz_callers(db, cast, job_spec, settings):
    """Returns the Authorization headers of a member (alice) and a capacity manager (carol), after
    seeding a fleet and a job of each team so ids in the schema's paths can hit something."""
    from fleet.services import fleet_generate
    from jobs.services import job_submit

    settings.MERIDIAN_LOGIN_FAILURE_LIMIT = 10_000  # the token endpoint is fuzzed with wrong passwords
    fleet_generate(regions=1, clusters=1, nodes=2, devices=4, accelerator_type="CPU", prefix="fz")
    job_submit(team=cast.team_a, submitted_by=cast.alice, spec=job_spec())
    job_submit(team=cast.team_b, submitted_by=cast.carol, spec=job_spec())
    return {user.username: {"Authorization": f"Token {Token.objects.get_or_create(user=user)[0].key}"}
            for user in (cast.alice, cast.carol)}


# Loaded at collection, from the running code's own /api/schema/ (it reads no database).
schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application()).exclude(
    path_regex="^/api/agent/")


@schema.parametrize()
@hypothesis.settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_the_api_answers_as_its_schema_says(case, fuzz_callers):
    for headers in fuzz_callers.values():
        case.call_and_validate(headers=headers, checks=CHECKS)


# The agent API, as a node: heartbeats, desired state and bundle fetches with a node token (the
# registration takes an enrollment token instead; tests/trust covers it).
agent_schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application()).include(
    path_regex="^/api/agent/").exclude(path_regex="^/api/agent/register/")


@pytest.fixture
def fuzz_node(db, settings):
    """Returns the Authorization header of node 1 of a small fleet (and a second node it is not)."""
    from fleet.models import Node
    from fleet.services import fleet_generate, node_token_issue

    fleet_generate(regions=1, clusters=1, nodes=2, devices=4, accelerator_type="CPU", prefix="fa")
    node = Node.objects.order_by("hostname").first()
    return {"Authorization": f"Node {node_token_issue(node=node)}"}


@agent_schema.parametrize()
@hypothesis.settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_the_agent_api_answers_as_its_schema_says(case, fuzz_node):
    case.call_and_validate(headers=fuzz_node, checks=CHECKS)
