from django.urls import path

from jobs import apis, bundle_apis, log_apis

urlpatterns = [
    path("jobs/", apis.JobCollectionApi.as_view(), name="api-job-list"),
    path("jobs/bulk/", apis.JobBulkSubmitApi.as_view(), name="api-job-bulk-submit"),
    path("jobs/<int:job_id>/", apis.JobDetailApi.as_view(), name="api-job-detail"),
    path("jobs/<int:job_id>/cancel/", apis.JobCancelApi.as_view(), name="api-job-cancel"),
    path("jobs/<int:job_id>/events/", apis.JobEventListApi.as_view(), name="api-job-events"),
    path("jobs/<int:job_id>/placement/", apis.JobPlacementApi.as_view(), name="api-job-placement"),
    path("jobs/<int:job_id>/logs/", log_apis.JobLogListApi.as_view(), name="api-job-logs"),
    path("jobs/<int:job_id>/outputs/", bundle_apis.JobOutputsApi.as_view(), name="api-job-outputs"),
    path("bundles/<str:sha256>/", bundle_apis.BundleDetailApi.as_view(), name="api-bundle-detail"),
    path("teams/", apis.TeamListApi.as_view(), name="api-team-list"),
    path("preemptions/", apis.PreemptionListApi.as_view(), name="api-preemption-list"),
    path("preemptions/<int:request_id>/approve/", apis.PreemptionApproveApi.as_view(), name="api-preemption-approve"),
    path("preemptions/<int:request_id>/deny/", apis.PreemptionDenyApi.as_view(), name="api-preemption-deny"),
]
