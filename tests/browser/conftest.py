"""Fixtures of the browser tests: one real portal (uvicorn + Redis + a private database)
and one headless Chromium for the session; a fresh browser context per test."""
import pytest
from browser_harness import PortalServer, chromium_launch, chromium_missing_reason, log_in


@pytest.fixture(scope="session")
def portal(django_db_blocker):
    reason = chromium_missing_reason()
    if reason:
        pytest.skip(reason)
    server = PortalServer()
    server.django_db_blocker = django_db_blocker
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def chromium(portal):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = chromium_launch(playwright)
        yield browser
        browser.close()


@pytest.fixture
def on_server(portal):
    """on_server(f, *args) → f(*args) run on the portal's database and Redis (see PortalServer.call)."""
    return portal.call


@pytest.fixture
def login(portal, chromium):
    """login("alice") → a Playwright page logged in as that demo user (own context)."""
    contexts = []

    def make(username):
        context = chromium.new_context(base_url=portal.url, viewport={"width": 1400, "height": 1000})
        contexts.append(context)
        return log_in(context, username)

    yield make
    for context in contexts:
        context.close()
