"""URLs. Pages mount under "" via `include`; the REST API under /api/."""
from django.contrib import admin
from django.urls import path

urlpatterns = [
    path("admin/", admin.site.urls),
]
