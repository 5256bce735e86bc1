"""/openapi.json: a valid OpenAPI 3.1 document that covers every route, and real responses match it."""

from __future__ import annotations

import re
from typing import Any

import pytest

from .conftest import make_settings, serve

try:  # optional: validate the whole document against the OpenAPI 3.1 meta-schema
    from openapi_spec_validator import validate as validate_openapi
except ImportError:  # pragma: no cover - the hand checks below still run
    validate_openapi = None

try:
    import jsonschema
except ImportError:  # pragma: no cover
    jsonschema = None

SESSIONS = "/v1/stream/sessions"
HIDDEN = {"/static/{name}"}  # the demo page's files


@pytest.fixture
async def doc_and_served():
    async with serve(make_settings(max_sessions_per_worker=1, queue_size=1)) as s:
        status, doc, response = await s.json("get", "/openapi.json")
        assert status == 200 and response.headers["Content-Type"].startswith("application/json")
        yield doc, s


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"unresolvable $ref {ref}"
        node = node[part]
    return node


def walk_refs(node: Any) -> list[str]:
    refs: list[str] = []
    if isinstance(node, dict):
        if "$ref" in node:
            refs.append(node["$ref"])
        for value in node.values():
            refs += walk_refs(value)
    elif isinstance(node, list):
        for value in node:
            refs += walk_refs(value)
    return refs


def openapi_path(rule: str) -> str:
    return re.sub(r"<(?:[a-z]+:)?([A-Za-z_]+)>", r"{\1}", rule)


async def test_document_structure_is_openapi_3_1(doc_and_served):
    doc, _ = doc_and_served
    assert doc["openapi"].startswith("3.1")
    assert doc["info"]["title"] and doc["info"]["version"]
    assert isinstance(doc["paths"], dict) and doc["paths"]
    for ref in walk_refs(doc):
        resolve(doc, ref)
    for path, item in doc["paths"].items():
        assert path.startswith("/")
        for name in re.findall(r"{([^}]+)}", path):
            for method, operation in item.items():
                declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
                assert name in declared, (path, method)
        for method, operation in item.items():
            assert method in {"get", "post", "put", "delete", "patch", "options", "head"}
            assert operation["responses"], (path, method)
            for code, response in operation["responses"].items():
                assert re.fullmatch(r"[1-5]\d\d", code), (path, method, code)
                assert response["description"]
    if validate_openapi is not None:
        validate_openapi(doc)


async def test_every_route_is_documented_with_its_methods(doc_and_served):
    doc, s = doc_and_served
    routes: dict[str, set[str]] = {}
    for rule in s.app.url_map.iter_rules():
        if getattr(rule, "websocket", False) or rule.endpoint == "static":
            continue
        path = openapi_path(rule.rule)
        if path in HIDDEN:
            continue
        methods = {m.lower() for m in rule.methods or ()} - {"head", "options"}
        routes.setdefault(path, set()).update(methods)
    assert "/v1/stream/sessions/{session_id}/tokens" in routes
    for path, methods in routes.items():
        assert path in doc["paths"], f"route {path} is not documented"
        assert methods <= set(doc["paths"][path]), (path, methods, sorted(doc["paths"][path]))
    for path in doc["paths"]:
        assert path in routes, f"documented path {path} has no route"


def check(doc: dict[str, Any], path: str, method: str, status: int, body: Any) -> None:
    """Validate a real response against the schema the document declares for it."""
    responses = doc["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method.upper()} {path} answered {status}, which is not documented"
    content = responses[str(status)].get("content", {})
    schema = content["application/json"]["schema"]
    if jsonschema is not None:
        wrapper = {**schema, "components": doc["components"]}
        jsonschema.Draft202012Validator(wrapper).validate(body)
    else:  # pragma: no cover - by hand: required keys and top-level types
        while "$ref" in schema:
            schema = resolve(doc, schema["$ref"])
        for key in schema.get("required", []):
            assert key in body, (path, status, key)


async def test_real_responses_match_their_schemas(doc_and_served):
    doc, s = doc_and_served
    status, created, _ = await s.create("ctl")
    check(doc, SESSIONS, "post", status, created)
    status, queued, _ = await s.create("next")
    check(doc, SESSIONS, "post", status, queued)
    assert status == 202
    status, body, _ = await s.create("third")
    check(doc, SESSIONS, "post", status, body)
    status, body, _ = await s.json("post", SESSIONS, json={"identity": "x", "bogus": 1})
    check(doc, SESSIONS, "post", status, body)
    item = "/v1/stream/sessions/{session_id}"
    sid = created["session_id"]
    for session_id in (sid, queued["session_id"], "nope"):
        status, body, _ = await s.json("get", f"{SESSIONS}/{session_id}")
        check(doc, item, "get", status, body)
    status, body, _ = await s.json("get", SESSIONS)
    check(doc, SESSIONS, "get", status, body)
    status, body, _ = await s.json("get", f"{SESSIONS}?status=bogus")
    check(doc, SESSIONS, "get", status, body)
    tokens = "/v1/stream/sessions/{session_id}/tokens"
    for session_id, identity in ((sid, "viewer"), (sid, "ctl"), (sid, "bad id"), ("nope", "v")):
        status, body, _ = await s.json("post", f"{SESSIONS}/{session_id}/tokens", json={"identity": identity})
        check(doc, tokens, "post", status, body)
    for path in ("/v1/stream/health", "/v1/service/health", "/v1/service/ready", "/v1/service/metadata",
                 "/v1/service/metrics/json", "/openapi.json"):
        status, body, _ = await s.json("get", path)
        check(doc, path, "get", status, body)
    for session_id in (sid, sid, "nope"):
        status, body, _ = await s.json("delete", f"{SESSIONS}/{session_id}")
        check(doc, item, "delete", status, body)
    response = await s.client.get("/v1/service/metrics")
    declared = doc["paths"]["/v1/service/metrics"]["get"]["responses"]["200"]["content"]
    assert response.headers["Content-Type"].split(";")[0] in declared


async def test_error_responses_declare_the_error_schema(doc_and_served):
    doc, _ = doc_and_served
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            for code, response in operation["responses"].items():
                if code.startswith(("4", "5")) and "content" in response:
                    schema = response["content"]["application/json"]["schema"]
                    target = resolve(doc, schema["$ref"]) if "$ref" in schema else schema
                    if path != "/v1/service/ready":  # its 503 carries the readiness body
                        assert target is doc["components"]["schemas"]["Error"], (path, method, code)


async def test_every_api_route_documents_the_refusal_of_input_it_would_ignore(doc_and_served):
    """A query parameter a route does not read, or a body on a GET or DELETE, is a 400 on every API route; the
    document listed a 400 on four of them (GET /v1/service/health?x=1 answered a 400 it did not list). And only
    a POST or DELETE is refused for a foreign page's origin (403), so no GET lists one."""
    doc, s = doc_and_served
    _, created, _ = await s.create("ctl")
    concrete = {"{session_id}": created["session_id"], "{worker_id}": "worker-0"}
    for path, item in doc["paths"].items():
        if path == "/":  # the demo page takes none of the API's rules
            continue
        url = path
        for name, value in concrete.items():
            url = url.replace(name, value)
        for method, operation in item.items():
            status, body, _ = await s.json(method, f"{url}?unknown=1", **({"json": {}} if method == "post" else {}))
            assert status == 400 and body["error"] == "invalid_query", (method, path, status, body)
            check(doc, path, method, status, body)
            if method in ("get", "delete"):
                status, body, _ = await s.json(method, url, data=b"{}")
                assert status == 400 and body["error"] == "invalid_body", (method, path, status, body)
                check(doc, path, method, status, body)
            if method == "get":
                assert "403" not in operation["responses"], (path, "a GET is never refused for its origin")


async def test_metadata_documents_the_session_inputs_a_create_may_give(doc_and_served):
    """``session_inputs`` is in the Metadata schema, and what the server says (the toy world's list, and the null
    of a server whose workers have not loaded the pipeline) is what the schema allows; a list past the two inputs
    is not."""
    doc, s = doc_and_served
    schema = doc["components"]["schemas"]["Metadata"]["properties"].get("session_inputs")
    assert schema is not None, "the Metadata schema does not document session_inputs"
    status, metadata, _ = await s.json("get", "/v1/service/metadata")
    assert status == 200 and metadata["session_inputs"] == ["prompt", "image"]
    if jsonschema is not None:
        validator = jsonschema.Draft202012Validator(schema)
        for value in (metadata["session_inputs"], None, [], ["image"]):
            validator.validate(value)
        assert not validator.is_valid(["prompt", "audio"]) and not validator.is_valid(["prompt", "prompt"])
