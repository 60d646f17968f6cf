"""URLs.

  /                    dashboard pages (portal.pages.urls)
  /accounts/login/ …   session login/logout (django.contrib.auth)
  /admin/              Django admin
  /metrics             Prometheus metrics, for an operator token (portal.metrics)
  /api/                REST API (fleet.urls, jobs.urls); /api/auth/token/ trades a username
                       and password for an API token; /api/schema/ (OpenAPI), /api/docs/
"""
from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView

from portal import views
from portal.auth import TokenObtainApi
from portal.metrics import metrics_view

api_patterns = [
    path("", include("fleet.urls")),
    path("agent/", include("jobs.agent_urls")),
    path("", include("jobs.urls")),
    path("auth/token/", TokenObtainApi.as_view(), name="api-token"),
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("docs/", views.api_docs, name="api-docs"),
]

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics", metrics_view, name="metrics"),  # Prometheus; an operator token (portal.metrics)
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("api/", include(api_patterns)),
    path("", include("portal.pages.urls")),
]


# An /api/ URL that matches nothing (e.g. /api/jobs/abc/) answers JSON like the rest of the API.
handler404 = "portal.views.not_found"
# A 500 outside DRF's views (a middleware, the URL layer) under /api/ is JSON too (production;
# DEBUG shows Django's debug page). Inside the API views portal.api_errors answers it.
handler500 = "portal.views.server_error"
