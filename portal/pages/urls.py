"""The dashboard pages, mounted at / by portal.urls (namespace "pages").

Static files are served here too, for the embedded deployment (daphne serves no
static files by itself); at scale put a web server or CDN in front of /static/.
"""
from django.conf import settings
from django.contrib.staticfiles.views import serve as static_serve
from django.urls import path, re_path

from portal.pages import views

app_name = "pages"

urlpatterns = [
    path("", views.fleet_page, name="fleet"),
    path("nodes/<int:node_id>/drain/", views.node_drain_page, name="node-drain"),
    path("nodes/<int:node_id>/undrain/", views.node_undrain_page, name="node-undrain"),
    path("jobs/", views.job_list_page, name="job-list"),
    path("jobs/submit/", views.job_submit_page, name="job-submit"),
    path("jobs/<int:job_id>/", views.job_detail_page, name="job-detail"),
    path("jobs/<int:job_id>/cancel/", views.job_cancel_page, name="job-cancel"),
    path("approvals/", views.approvals_page, name="approvals"),
    path("approvals/<int:request_id>/decide/", views.approval_decide_page, name="approval-decide"),
    path("teams/", views.team_list_page, name="teams"),
    re_path(
        r"^%s(?P<path>.*)$" % settings.STATIC_URL.lstrip("/"),
        static_serve,
        {"insecure": True},
        name="static",
    ),
]
