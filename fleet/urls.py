from django.urls import path

from fleet import apis

urlpatterns = [
    path("fleet/summary/", apis.FleetSummaryApi.as_view(), name="api-fleet-summary"),
    path("fleet/utilization/", apis.TelemetrySeriesApi.as_view(), name="api-fleet-utilization"),
    path("nodes/", apis.NodeListApi.as_view(), name="api-node-list"),
    path("nodes/<int:node_id>/", apis.NodeDetailApi.as_view(), name="api-node-detail"),
    path("nodes/<int:node_id>/drain/", apis.NodeDrainApi.as_view(), name="api-node-drain"),
    path("nodes/<int:node_id>/undrain/", apis.NodeUndrainApi.as_view(), name="api-node-undrain"),
    path("accelerators/", apis.AcceleratorListApi.as_view(), name="api-accelerator-list"),
]
