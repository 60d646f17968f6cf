"""CI from issue 15 on: the authorization matrix, table-driven. Every endpoint (the user API, the
pages, the agent API, the token endpoint) x every kind of caller:

  anonymous       no credentials
  member          alice, member of team A, whose job and preemption request the URLs name
  other_team      charlie, member of team B only: must see nothing of A's
  capacity_mgr    carol, capacity manager of A and B
  admin           a global admin (superuser)
  node            node n1's agent token (`Authorization: Node ...`)
  other_node      node n2's agent token
  revoked         node n3's token, revoked

Users call the API with their API token (`Authorization: Token ...`) and the pages with a
session, as a browser does. One test per cell, each on a fresh database, so a write (a cancel,
an approval) in one cell cannot change another's answer.

Rules the table encodes: anonymous and node callers get 401 from the user API (it speaks to
users) and the login page from the pages; another team's objects are 404, never 403 (their
existence is not the caller's business); deciding a preemption needs the capacity-manager role
(403 for a member who can see it); the agent API takes node tokens only (401 for users), and a
node reads only its own desired state (403 for another node's id).
"""
import hashlib
import io

import pytest
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet.models import Node
from fleet.services import fleet_generate, node_token_issue, node_token_revoke
from jobs.bundles import bundle_store
from jobs.models import Job, Replica
from jobs.services import job_submit, preemption_request_create
from protocol import bundle as bundle_format

CALLERS = ["anonymous", "member", "other_team", "capacity_mgr", "admin", "node", "other_node", "revoked"]
USERS = {"member": "alice", "other_team": "charlie", "capacity_mgr": "carol", "admin": "admin"}
NODE_CALLERS = {"node", "other_node", "revoked"}

SUBMIT_A = {"team": "{team_a_slug}", "name": "m", "accelerator_type": "CPU", "world_size": 4, "min_devices": 2,
            "entrypoint": "train.py"}


def users(ok, *, other_team=None, member=None, capacity_mgr=None, admin=None, anonymous=401, nodes=401):
    """Returns {caller: status}: `ok` for every user unless overridden, `anonymous` and `nodes` else."""
    answer = {"anonymous": anonymous, **{caller: nodes for caller in NODE_CALLERS}}
    for caller, override in (("member", member), ("other_team", other_team), ("capacity_mgr", capacity_mgr),
                             ("admin", admin)):
        answer[caller] = ok if override is None else override
    return answer


PAGE_LOGIN = 302  # pages send anyone not logged in (node tokens included) to the login page
AGENT = {"anonymous": 401, **{caller: 401 for caller in USERS}, "node": 200, "other_node": 200, "revoked": 401}

# (method, path, body, {caller: status})
MATRIX = [
    # the user API
    ("GET", "/api/jobs/", None, users(200)),
    ("POST", "/api/jobs/", SUBMIT_A, users(201, other_team=400)),  # charlie is not on team A: 400 naming team
    ("POST", "/api/jobs/bulk/", {"team": "{team_a_slug}", "jobs": [{k: v for k, v in SUBMIT_A.items() if k != "team"}]},
     users(201, other_team=400)),
    ("GET", "/api/jobs/{job_a}/", None, users(200, other_team=404)),
    ("POST", "/api/jobs/{job_a}/cancel/", None, users(200, other_team=404)),
    ("GET", "/api/jobs/{job_a}/events/", None, users(200, other_team=404)),
    ("GET", "/api/jobs/{job_a}/placement/", None, users(200, other_team=404)),
    ("GET", "/api/jobs/{job_a}/logs/", None, users(200, other_team=404)),
    # job_a has saved no outputs yet: 404 for whoever may see it, the same 404 for another team
    ("GET", "/api/jobs/{job_a}/outputs/", None, users(404)),
    # a bundle is visible to those who uploaded it (alice) only: a digest alone grants nothing
    ("GET", "/api/bundles/{bundle_a}/", None, users(404, member=200)),
    ("GET", "/api/teams/", None, users(200)),
    ("GET", "/api/preemptions/", None, users(200)),
    ("POST", "/api/preemptions/{request_a}/approve/", {"note": "ok"}, users(200, member=403, other_team=404)),
    ("POST", "/api/preemptions/{request_a}/deny/", {"note": "no"}, users(200, member=403, other_team=404)),
    ("GET", "/api/fleet/summary/", None, users(200)),
    ("GET", "/api/fleet/utilization/", None, users(200)),
    ("GET", "/api/nodes/", None, users(200)),
    ("GET", "/api/nodes/{node_1}/", None, users(200)),
    # draining is fleet-wide: global admins only, a team's capacity manager included in the 403s
    ("POST", "/api/nodes/{node_1}/drain/", {"reason": "replace GPU 3"},
     users(403, admin=200)),
    ("POST", "/api/nodes/{node_1}/undrain/", {}, users(403, admin=200)),
    ("GET", "/api/accelerators/", None, users(200)),
    # public: the schema and the token endpoint (which checks the password it is given)
    ("GET", "/api/schema/", None, users(200, anonymous=200, nodes=200)),
    ("POST", "/api/auth/token/", {"username": "alice", "password": "alice-demo-pass"},
     users(200, anonymous=200, nodes=200)),
    # the agent API: node tokens only, a node's own state only
    ("GET", "/api/agent/desired/", None, AGENT),
    ("GET", "/api/agent/nodes/{node_1}/desired/", None, {**AGENT, "other_node": 403}),
    ("POST", "/api/agent/heartbeat/", {"jobs": []}, AGENT),
    ("POST", "/api/agent/logs/", {"chunks": []}, AGENT),
    # job_a (which uses bundle_a) has a replica on n1 only: another node may not fetch its code
    ("GET", "/api/agent/bundles/{bundle_a}/", None, {**AGENT, "other_node": 404}),
    # Prometheus metrics: an operator token only (tests/portal/test_metrics.py); no user, session or node opens it
    ("GET", "/metrics", None, {caller: 401 for caller in CALLERS}),
    # the pages
    ("GET", "/", None, users(200, anonymous=PAGE_LOGIN, nodes=PAGE_LOGIN)),
    ("GET", "/jobs/", None, users(200, anonymous=PAGE_LOGIN, nodes=PAGE_LOGIN)),
    ("GET", "/jobs/{job_a}/", None, users(200, other_team=404, anonymous=PAGE_LOGIN, nodes=PAGE_LOGIN)),
    ("POST", "/jobs/{job_a}/cancel/", {}, users(302, other_team=404, anonymous=PAGE_LOGIN, nodes=PAGE_LOGIN)),
    ("GET", "/jobs/submit/", None, users(200, anonymous=PAGE_LOGIN, nodes=PAGE_LOGIN)),
    ("GET", "/approvals/", None, users(200, member=403, other_team=403, anonymous=PAGE_LOGIN, nodes=PAGE_LOGIN)),
    ("POST", "/approvals/{request_a}/decide/", {"decision": "approve", "note": ""},
     users(302, member=403, other_team=403, anonymous=PAGE_LOGIN, nodes=PAGE_LOGIN)),
    ("GET", "/teams/", None, users(200, anonymous=PAGE_LOGIN, nodes=PAGE_LOGIN)),
]


@pytest.fixture
def world(cast, settings):
    """The objects the URLs name and every caller's credentials."""
    settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN = "matrix-enroll"
    fleet_generate(regions=1, clusters=1, nodes=3, devices=2, accelerator_type="CPU", prefix="mx")
    nodes = list(Node.objects.order_by("hostname"))
    job_a = job_submit(team=cast.team_a, submitted_by=cast.alice, spec={
        "name": "a-job", "accelerator_type": "CPU", "world_size": 4, "min_devices": 2, "entrypoint": "train.py"})
    request_a = preemption_request_create(job=job_a, reason="room for another job", lost_work_seconds=1.0)
    archive = bundle_format.pack_bytes({"train.py": b"print('hi')\n"})
    bundle_a, _ = bundle_store(stream=io.BytesIO(archive), sha256=hashlib.sha256(archive).hexdigest(),
                               user=cast.alice)
    Job.objects.filter(pk=job_a.pk).update(bundle=bundle_a)
    Replica.objects.filter(job=job_a, rank=0).update(device=nodes[0].accelerators.first())
    node_tokens = {"node": node_token_issue(node=nodes[0]), "other_node": node_token_issue(node=nodes[1]),
                   "revoked": node_token_issue(node=nodes[2])}
    node_token_revoke(node=nodes[2])
    return {
        "ids": {"job_a": job_a.pk, "request_a": request_a.pk, "node_1": nodes[0].pk,
                "team_a_slug": cast.team_a.slug, "bundle_a": bundle_a.sha256},
        "users": {caller: getattr(cast, name) for caller, name in USERS.items()},
        "node_tokens": node_tokens,
    }


def _fill(value, ids):
    if isinstance(value, str):
        return value.format(**ids)
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    return value


def _client(world, caller, *, api):
    if caller in USERS:
        user = world["users"][caller]
        if api:
            client = APIClient()
            client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
        else:
            client = Client()
            client.force_login(user)
        return client
    client = APIClient() if api else Client()
    if caller in NODE_CALLERS:
        header = f"Node {world['node_tokens'][caller]}"
        if api:
            client.credentials(HTTP_AUTHORIZATION=header)
        else:
            client.defaults["HTTP_AUTHORIZATION"] = header
    return client


CELLS = [pytest.param(method, path, body, caller, expected[caller], id=f"{method} {path} as {caller}")
         for method, path, body, expected in MATRIX for caller in CALLERS]


@pytest.mark.parametrize("method, path, body, caller, expected", CELLS)
def test_the_authorization_matrix(world, method, path, body, caller, expected):
    api = path.startswith("/api/")
    client = _client(world, caller, api=api)
    url = _fill(path, world["ids"])
    if method == "GET":
        response = client.get(url)
    elif api:
        response = client.post(url, _fill(body, world["ids"]), format="json")
    else:
        response = client.post(url, _fill(body, world["ids"]))

    assert response.status_code == expected, f"{method} {url} as {caller}: {response.content[:300]!r}"
    if expected == 401:
        assert response.has_header("WWW-Authenticate")  # says which credentials to send
    if expected == PAGE_LOGIN and caller not in USERS:
        assert response["Location"].startswith("/accounts/login/")


@pytest.mark.parametrize("caller", ["other_team"])
def test_another_team_sees_none_of_its_jobs_or_requests_in_lists(world, caller):
    client = _client(world, caller, api=True)

    jobs = client.get("/api/jobs/").json()["results"]
    requests = client.get("/api/preemptions/").json()["results"]

    assert world["ids"]["job_a"] not in {job["id"] for job in jobs}
    assert world["ids"]["request_a"] not in {request["id"] for request in requests}


def test_every_api_route_is_in_the_matrix():
    """A new endpoint must get its row: the matrix lists every path of the generated schema."""
    from drf_spectacular.generators import SchemaGenerator

    documented = set(SchemaGenerator().get_schema(request=None, public=True)["paths"])
    in_matrix = {path.replace("{job_a}", "{job_id}").replace("{request_a}", "{request_id}")
                 .replace("{node_1}", "{node_id}").replace("{bundle_a}", "{sha256}")
                  for _, path, _, _ in MATRIX if path.startswith("/api/")}
    missing = documented - in_matrix - {"/api/agent/register/"}  # enrollment: the node-side tests
    assert not missing, f"add rows to MATRIX for {sorted(missing)}"
