from django.urls import path

from jobs import agent_apis, bundle_apis

urlpatterns = [
    path("register/", agent_apis.NodeRegisterApi.as_view(), name="api-agent-register"),
    path("heartbeat/", agent_apis.NodeHeartbeatApi.as_view(), name="api-agent-heartbeat"),
    path("bundles/<str:sha256>/", bundle_apis.AgentBundleApi.as_view(), name="api-agent-bundle"),
    path("desired/", agent_apis.NodeDesiredStateApi.as_view(), name="api-agent-desired"),
    path("nodes/<int:node_id>/desired/", agent_apis.NodeDesiredStateApi.as_view(), name="api-agent-node-desired"),
]
