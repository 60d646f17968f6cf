"""drf-spectacular postprocessing: the error answers every operation can give, documented.

Views document their 2xx bodies; the 4xx a person can get are the same everywhere (see
portal.api_errors), so they are added here, once, from what an operation has:
  400  it takes a body, query parameters or a checked path string (a digest): {field: [message, ...]}
  401  it needs credentials (all but the token endpoint)   {"detail": ...}, WWW-Authenticate
  403  the caller may not do this                {"detail": ...}
  404  a path id the caller may not see (or that does not exist); a telemetry scope that does not
  409  a state change the job's state forbids (cancel, approve, deny)
  413  a body over MERIDIAN_MAX_BODY_BYTES;  415  a body that is not JSON (or a form, for the token)
  429  too many failed logins (the token endpoint)
"""
ERROR = {
    "type": "object",
    "description": "What went wrong, for a person: {\"detail\": message}",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}
VALIDATION_ERROR = {
    "type": "object",
    "description": "Each bad field (or non_field_errors, or detail) with the messages that say what to change",
    "additionalProperties": {},
}
DESCRIPTIONS = {
    "400": "bad input: the body names each bad field",
    "401": "no credentials, or unknown or revoked ones",
    "403": "you may not do this",
    "404": "no such object among those you may see",
    "409": "the state machine forbids this change now",
    "413": "request body too large",
    "415": "the body's media type is not accepted",
    "429": "too many failed logins for this account or from this address",
}
CONFLICTS = ("/cancel/", "/approve/", "/deny/")
NOT_FOUND_WITHOUT_PATH_ID = ("/api/fleet/utilization/",)
TOKEN_PATH = "/api/auth/token/"


def _response(code):
    schema = "ValidationError" if code == "400" else "Error"
    return {"description": DESCRIPTIONS[code],
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}


def errors_documented(result, generator, request, public):
    """POSTPROCESSING_HOOKS entry: adds the Error components and each operation's 4xx answers."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas.setdefault("Error", ERROR)
    schemas.setdefault("ValidationError", VALIDATION_ERROR)
    for path, item in result.get("paths", {}).items():
        for method, operation in item.items():
            if method not in {"get", "post", "put", "patch", "delete"}:
                continue
            parameters = operation.get("parameters", [])
            codes = set()
            if "requestBody" in operation or any(
                    p.get("in") == "query" or (p.get("in") == "path" and p.get("schema", {}).get("type") == "string")
                    for p in parameters):  # a path string with a format (a sha256) is checked: 400 naming it
                codes.add("400")
            if "requestBody" in operation:
                codes |= {"413", "415"}
            if path == TOKEN_PATH:
                codes.add("429")
            else:
                codes |= {"401", "403"}
            if any(p.get("in") == "path" for p in parameters) or path in NOT_FOUND_WITHOUT_PATH_ID:
                codes.add("404")
            if method == "post" and path.endswith(CONFLICTS):
                codes.add("409")
            responses = operation.setdefault("responses", {})
            for code in sorted(codes):
                responses.setdefault(code, _response(code))
    return result
