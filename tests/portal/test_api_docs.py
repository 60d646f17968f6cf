"""The OpenAPI schema is generated and the docs page renders it locally (no CDN)."""


def test_the_schema_lists_every_api(client, db):
    response = client.get("/api/schema/", {"format": "json"})

    assert response.status_code == 200
    paths = response.json()["paths"]
    for path in ("/api/jobs/", "/api/jobs/{job_id}/", "/api/jobs/{job_id}/cancel/", "/api/jobs/{job_id}/events/",
                 "/api/fleet/summary/", "/api/nodes/", "/api/nodes/{node_id}/", "/api/accelerators/",
                 "/api/preemptions/", "/api/preemptions/{request_id}/approve/", "/api/preemptions/{request_id}/deny/"):
        assert path in paths, path
    assert set(paths["/api/jobs/"]) >= {"get", "post"}


def test_the_docs_page_renders_without_external_assets(client, db):
    response = client.get("/api/docs/")

    html = response.content.decode()
    assert response.status_code == 200
    assert "POST /api/jobs/" in html and "world_size" in html
    assert "http://" not in html.replace("http://testserver", "") and "https://" not in html


def test_the_login_page_renders_and_logs_in(client, alice):
    assert "Log in to Meridian" in client.get("/accounts/login/").content.decode()

    response = client.post("/accounts/login/", {"username": "alice", "password": "alice-demo-pass"})

    assert response.status_code == 302
    assert client.get("/api/jobs/").status_code == 200
