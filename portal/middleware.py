"""Response headers of every page and API answer.

ContentSecurityPolicyMiddleware sets Content-Security-Policy from
settings.MERIDIAN_CONTENT_SECURITY_POLICY ("{host}" becomes the request's host, for the live
WebSocket). The pages load only their own scripts (static/pages/*.js and the vendored Plotly; no
inline script or event handler: data reaches them through json_script, which is not executed);
inline styles stay allowed because Plotly draws with them and a few templates set widths.
"""
from django.conf import settings


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        policy = settings.MERIDIAN_CONTENT_SECURITY_POLICY
        if policy and "Content-Security-Policy" not in response:
            response["Content-Security-Policy"] = policy.replace("{host}", request.get_host())
        return response
