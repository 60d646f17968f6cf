"""Finding Medium 8 (the OpenAPI schema matches the responses) and the Low finding "no
Content-Security-Policy" (issue 15)."""
import re
from pathlib import Path

import pytest
from drf_spectacular.generators import SchemaGenerator

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
LISTS = ["/api/jobs/", "/api/jobs/{job_id}/events/", "/api/teams/", "/api/preemptions/", "/api/nodes/",
         "/api/accelerators/"]


@pytest.fixture(scope="module")
def schema():
    return SchemaGenerator().get_schema(request=None, public=True)


def _ok_schema(schema, path, method="get"):
    content = schema["paths"][path][method]["responses"]
    ok = content.get("200") or content.get("201")
    ref = ok["content"]["application/json"]["schema"]["$ref"]
    return schema["components"]["schemas"][ref.rsplit("/", 1)[-1]]


@pytest.mark.parametrize("path", LISTS)
def test_list_endpoints_are_documented_as_paginated_objects(schema, path):
    body = _ok_schema(schema, path)

    assert body["type"] == "object"
    assert {"count", "next", "previous", "results"} <= set(body["properties"])
    assert body["properties"]["results"]["type"] == "array"


@pytest.mark.parametrize("field", ["region", "submitted_by", "total_steps", "queue_position", "started_at"])
def test_job_fields_that_can_be_null_are_nullable(schema, field):
    assert schema["components"]["schemas"]["Job"]["properties"][field].get("nullable") is True


def test_every_operation_documents_its_4xx(schema):
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            codes = set(operation["responses"])
            if path == "/api/auth/token/":
                assert {"400", "429"} <= codes
                continue
            assert {"401", "403"} <= codes, (method, path)
            if "{" in path:
                assert "404" in codes, (method, path)
            if "requestBody" in operation:
                assert {"400", "413"} <= codes, (method, path)
    assert "409" in schema["paths"]["/api/jobs/{job_id}/cancel/"]["post"]["responses"]


def test_the_agent_api_bodies_are_documented(schema):
    for path in ("/api/agent/heartbeat/", "/api/agent/register/"):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = body["$ref"].rsplit("/", 1)[-1]
        assert schema["components"]["schemas"][name].get("properties"), path


def test_pages_carry_a_content_security_policy_without_inline_script(client, alice):
    client.force_login(alice)
    policy = client.get("/").headers["Content-Security-Policy"]

    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["script-src"] == "'self'"  # no 'unsafe-inline', no 'unsafe-eval'
    assert directives["object-src"] == "'none'" and directives["frame-ancestors"] == "'none'"
    assert "ws://testserver" in directives["connect-src"]  # the live socket
    assert "Content-Security-Policy" in client.get("/api/jobs/").headers


def test_no_template_has_an_inline_script_or_event_handler():
    """What the policy would block: <script> without src (json_script data is not executed and is
    allowed) and on*= attributes."""
    for template in TEMPLATES.rglob("*.html"):
        text = template.read_text()
        assert not re.search(r"\son[a-z]+\s*=", text), template
        for tag in re.findall(r"<script\b[^>]*>", text):
            assert "src=" in tag or 'type="application/json"' in tag, (template, tag)
