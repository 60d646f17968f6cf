"""Views of the project itself: the API docs page (the dashboard's pages are portal/pages/)."""
from django.http import JsonResponse
from django.shortcuts import render
from django.views.defaults import page_not_found
from django.views.defaults import server_error as django_server_error
from drf_spectacular.generators import SchemaGenerator

HTTP_METHODS = ("get", "post", "put", "patch", "delete")


def not_found(request, exception):
    """handler404: JSON under /api/ ({"detail": ...}, as every API answer), Django's page elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": f"no API endpoint or object at {request.path[:200]}; the endpoints "
                                       f"are listed at /api/docs/"}, status=404)
    return page_not_found(request, exception)


def server_error(request):
    """handler500: JSON under /api/, Django's page elsewhere (the traceback is in the log)."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "internal error; it is logged: tell the operator the time and the URL"},
                            status=500)
    return django_server_error(request)


def _schema_ref(schema, ref):
    name = ref.rsplit("/", 1)[-1]
    return name, schema.get("components", {}).get("schemas", {}).get(name, {})


def _fields(schema, body):
    """Returns [(name, type, required, description)] of a JSON request body schema."""
    content = (body or {}).get("content", {}).get("application/json", {}).get("schema", {})
    if "$ref" in content:
        _, content = _schema_ref(schema, content["$ref"])
    required = set(content.get("required", []))
    rows = []
    for name, prop in content.get("properties", {}).items():
        kind = prop.get("type") or (_schema_ref(schema, prop["$ref"])[0] if "$ref" in prop else "")
        if "enum" in prop:
            kind = " | ".join(map(str, prop["enum"]))
        elif "allOf" in prop:
            ref = prop["allOf"][0].get("$ref", "")
            _, target = _schema_ref(schema, ref)
            kind = " | ".join(map(str, target.get("enum", []))) or ref.rsplit("/", 1)[-1]
        rows.append((name, kind, name in required, prop.get("description", "")))
    return rows


def api_docs(request):
    """Renders the generated OpenAPI schema as a plain page (no CDN, no JavaScript):
    every path, method, summary, parameters and request body fields."""
    schema = SchemaGenerator().get_schema(request=None, public=True)
    operations = []
    for path, item in schema.get("paths", {}).items():
        for method in HTTP_METHODS:
            operation = item.get(method)
            if not operation:
                continue
            operations.append(
                {
                    "method": method.upper(),
                    "path": path,
                    "summary": operation.get("summary") or operation.get("operationId", ""),
                    "description": operation.get("description", ""),
                    "parameters": [
                        (p["name"], p.get("in", ""), p.get("schema", {}).get("type", ""), p.get("description", ""))
                        for p in operation.get("parameters", [])
                    ],
                    "fields": _fields(schema, operation.get("requestBody")),
                    "responses": sorted(operation.get("responses", {})),
                }
            )
    return render(request, "portal/api_docs.html", {"info": schema.get("info", {}), "operations": operations})
