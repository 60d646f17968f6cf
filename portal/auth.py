"""Logins: brute-force protection (django-axes) and the API token endpoint.

Every password login goes through django.contrib.auth.authenticate with the request: the page
/accounts/login/, the admin's /admin/login/ and /api/auth/token/. django-axes counts the failures
per account and per address (settings.AXES_LOCKOUT_PARAMETERS) and, at
settings.MERIDIAN_LOGIN_FAILURE_LIMIT failures, refuses further attempts of that account, or from
that address, for settings.MERIDIAN_LOGIN_LOCKOUT_MINUTES, even with the right password: a 429
with a message (lockout_response). The lock ends after that cool-off (or manage.py axes_reset).
"""
from __future__ import annotations

from datetime import timedelta

from axes.backends import AxesStandaloneBackend
from django.conf import settings
from django.contrib.auth import authenticate
from django.http import HttpResponse, JsonResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.authtoken.models import Token
from rest_framework.exceptions import ValidationError
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.api_errors import BoundedJSONParser


def login_failure_limit(request=None, credentials=None) -> int:
    """settings.AXES_FAILURE_LIMIT: failures per account, and per address, before the lock."""
    return int(settings.MERIDIAN_LOGIN_FAILURE_LIMIT)


def login_lockout_time(request=None) -> timedelta:
    """settings.AXES_COOLOFF_TIME: how long a lock lasts."""
    return timedelta(minutes=float(settings.MERIDIAN_LOGIN_LOCKOUT_MINUTES))


def lockout_message() -> str:
    minutes = float(settings.MERIDIAN_LOGIN_LOCKOUT_MINUTES)
    return (f"too many failed logins for this account or from this address: logins are refused for "
            f"{minutes:g} minutes, even with the right password. Wait, or ask an operator to unlock it "
            f"(manage.py axes_reset_username <name>, or axes_reset_ip <address>).")


def lockout_response(request, original_response=None, credentials=None) -> HttpResponse:
    """settings.AXES_LOCKOUT_CALLABLE: a 429 with lockout_message(), JSON under /api/, text elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": lockout_message()}, status=status.HTTP_429_TOO_MANY_REQUESTS)
    return HttpResponse(lockout_message(), status=status.HTTP_429_TOO_MANY_REQUESTS,
                        content_type="text/plain; charset=utf-8")


class LoginThrottleBackend(AxesStandaloneBackend):
    """django-axes' lockout check, first in AUTHENTICATION_BACKENDS; ModelBackend then logs in.

    A login without a request (the shell, a management command, a test's client.login) has no
    address to count and is not an attack surface: it is let through to the next backend instead
    of raising as axes' own backend does."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)


class TokenObtainApi(APIView):
    """POST /api/auth/token/ {username, password} -> {token}: DRF's obtain_auth_token, but through
    the same lockout as the login pages, with Meridian's bounded JSON parser and error bodies."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    parser_classes = [BoundedJSONParser, FormParser, MultiPartParser]

    @extend_schema_serializer(component_name="TokenObtainInput")
    class InputSerializer(serializers.Serializer):
        username = serializers.CharField(max_length=150)
        password = serializers.CharField(max_length=4096, trim_whitespace=False, style={"input_type": "password"})

    @extend_schema_serializer(component_name="TokenObtainOutput")
    class OutputSerializer(serializers.Serializer):
        token = serializers.CharField()

    @extend_schema(
        request=InputSerializer, summary="Trade a username and password for an API token",
        responses={200: OutputSerializer,
                   429: OpenApiResponse(description="too many failed logins for the account or from the address")},
    )
    def post(self, request):
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        http_request = request._request  # axes flags the Django request (axes_locked_out)
        user = authenticate(request=http_request, username=serializer.validated_data["username"],
                            password=serializer.validated_data["password"])
        if getattr(http_request, "axes_locked_out", False):
            return Response({"detail": lockout_message()}, status=status.HTTP_429_TOO_MANY_REQUESTS)
        if user is None or not user.is_active:
            raise ValidationError({"non_field_errors": ["wrong username or password"]})
        token, _ = Token.objects.get_or_create(user=user)
        return Response(self.OutputSerializer({"token": token.key}).data)
