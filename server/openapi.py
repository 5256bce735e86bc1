"""The OpenAPI 3.1 document of the HTTP API (served at ``/openapi.json``).

Written by hand next to the routes it describes; a test checks that every
route of the app appears here and that responses match their schemas.
"""

from __future__ import annotations

from typing import Any

from states.stream_session import DrainCause, State

from .requests import LIST_LIMIT, MAX_LIST_LIMIT

__all__ = ["openapi_document"]

# generated from the enums, so the document cannot drift from the table
STATUSES = [state.value for state in State]
DRAIN_CAUSES = [cause.value for cause in DrainCause]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("Error"), description)


NULLABLE_STR = {"type": ["string", "null"]}
NULLABLE_NUM = {"type": ["number", "null"]}
NULLABLE_INT = {"type": ["integer", "null"]}

#: what a create's prompt and image fields say of a pipeline that does not take them
TAKEN_ONLY = ("only for a pipeline that takes it: given to one that does not, the create is a 400 invalid_input "
              "naming the field and the pipeline, before anything is held; one the pipeline's check_image refuses (a "
              "size it cannot use) is a 400 invalid_image naming the field, before anything is held too")

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error", "detail"],
        "properties": {"error": {"type": "string"}, "detail": {"type": "string"}},
    },
    "SessionCreateRequest": {
        "type": "object",
        "additionalProperties": False,
        "required": ["identity"],
        "properties": {
            "identity": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[A-Za-z0-9_.:@-]+$"},
            "role": {"type": "string", "enum": ["controller"]},
            "prompt": {"type": ["string", "null"], "maxLength": 2000,
                       "description": f"{TAKEN_ONLY} (its service's takes_prompt)"},
            "image_path": {"type": ["string", "null"],
                           "description": f"a file's path relative to the server's --assets-dir, parts separated "
                                          f"by '/' (no '..', no trailing '/', no backslash, NUL or control "
                                          f"character: each a 400 invalid_image_path naming it); {TAKEN_ONLY} "
                                          f"(takes_image)"},
            "image_b64": {"type": ["string", "null"],
                          "description": f"an uploaded image (PNG, JPEG, GIF, BMP or WebP), base64; {TAKEN_ONLY} "
                                         f"(takes_image)"},
            "config": {"type": "object", "description": "pipeline options (e.g. continuous, chunks), checked by the "
                       "pipeline before anything is held: a refused one is a 400 invalid_option naming it"},
        },
    },
    "SessionCreateResponse": {
        "type": "object",
        "required": ["session_id", "room", "token", "status", "transport"],
        "properties": {
            "session_id": {"type": "string"},
            "room": {"type": "string"},
            "livekit_url": NULLABLE_STR,
            "transport": {"type": "string", "enum": ["local", "livekit"]},
            "websocket_path": NULLABLE_STR,
            "token": {"type": "string"},
            "worker_id": NULLABLE_STR,
            "status": {"type": "string", "enum": STATUSES},
            "expires_at": NULLABLE_NUM,
            "queue_position": NULLABLE_INT,
        },
    },
    "SessionStatus": {
        "type": "object",
        "required": ["session_id", "room", "status", "created_at", "updated_at", "participant_count"],
        "properties": {
            "session_id": {"type": "string"},
            "room": {"type": "string"},
            "status": {"type": "string", "enum": STATUSES},
            "worker_id": NULLABLE_STR,
            "pipeline_session_id": NULLABLE_STR,
            "created_at": {"type": "number"},
            "updated_at": {"type": "number"},
            "expires_at": NULLABLE_NUM,
            "participant_count": {"type": "integer", "minimum": 0},
            "queue_position": NULLABLE_INT,
            "error": NULLABLE_STR,
            "drain_cause": {"type": ["string", "null"], "enum": [*DRAIN_CAUSES, None],
                            "description": "why the session ended (or is ending); set once, the first cause wins"},
        },
    },
    "SessionList": {"type": "object", "required": ["sessions", "next"],
                    "properties": {"sessions": {"type": "array", "items": _ref("SessionStatus")},
                                   "next": {"type": ["string", "null"],
                                            "description": "the cursor of the next page (its `after`); null on the last"}}},
    "SessionDeleteResponse": {
        "type": "object",
        "required": ["session_id", "status"],
        "properties": {"session_id": {"type": "string"}, "status": {"type": "string", "enum": STATUSES}},
    },
    "TokenRequest": {
        "type": "object",
        "additionalProperties": False,
        "required": ["identity"],
        "properties": {
            "identity": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[A-Za-z0-9_.:@-]+$"},
            "role": {"type": "string", "enum": ["viewer"]},
        },
    },
    "TokenResponse": {
        "type": "object",
        "required": ["session_id", "room", "token", "role", "identity"],
        "properties": {
            "session_id": {"type": "string"},
            "room": {"type": "string"},
            "livekit_url": NULLABLE_STR,
            "transport": {"type": "string", "enum": ["local", "livekit"]},
            "websocket_path": NULLABLE_STR,
            "token": {"type": "string"},
            "role": {"type": "string", "enum": ["viewer"]},
            "identity": {"type": "string"},
        },
    },
    "Health": {
        "type": "object",
        "required": ["status", "transport", "workers_total", "workers_idle", "workers_busy", "workers_starting",
                     "workers_draining", "workers_failed", "workers_stopped", "queued_sessions"],
        "properties": {
            "status": {"type": "string", "enum": ["healthy", "degraded", "unhealthy"]},
            "transport": {"type": "string"},
            "transport_connected": {"type": "boolean"},
            "livekit_connected": {"type": "boolean", "description": "the seed's name: an alias of transport_connected"},
            "workers_total": {"type": "integer", "description": "one per worker place (an in-process slot's current "
                              "worker, or an agent), never a failed worker its slot replaced: workers_starting + "
                              "workers_idle + workers_busy + workers_draining + workers_failed + workers_stopped"},
            "workers_idle": {"type": "integer"},
            "workers_busy": {"type": "integer"},
            "workers_starting": {"type": "integer", "description": "loading the pipeline"},
            "workers_draining": {"type": "integer"},
            "workers_failed": {"type": "integer", "description": "current workers that failed (a slot backing off "
                               "before its restart, or one that gave up)"},
            "workers_stopped": {"type": "integer", "description": "drained on purpose"},
            "queued_sessions": {"type": "integer"},
            "retained_sessions": {"type": "integer"},
            "shutting_down": {"type": "boolean", "description": "the server is draining to stop: creates are a 429 "
                              "shutting_down (free_slots is 0 meanwhile)"},
            "free_slots": {"type": "integer", "description": "sessions a create could still start now"},
            "worker_restarts": {"type": "integer"},
            "worker_slots": {"type": "object", "description": "per slot: worker_id (its current worker), restarts, "
                             "state (running, backing_off, gave_up, stopped), reason (why it is not running, else "
                             "null) and, for an in-process slot, replaced (the failed worker it replaced last: "
                             "worker_id and failure, else null)",
                             "additionalProperties": {
                                 "type": "object", "required": ["worker_id", "restarts", "state", "reason"],
                                 "properties": {"worker_id": NULLABLE_STR, "restarts": {"type": "integer"},
                                                "state": {"type": "string",
                                                          "enum": ["running", "backing_off", "gave_up", "stopped"]},
                                                "reason": NULLABLE_STR,
                                                "replaced": {"type": ["object", "null"],
                                                             "required": ["worker_id", "failure"],
                                                             "properties": {"worker_id": {"type": "string"},
                                                                            "failure": NULLABLE_STR}}}}},
            "workers": {"type": "array", "description": "the workers counted in workers_total",
                        "items": {"type": "object", "required": ["worker_id", "state", "capacity", "retained",
                                                                 "launcher"]}},
        },
    },
    "ServiceHealth": {"allOf": [_ref("Health"), {"type": "object", "required": ["ready", "service_type"],
                                                 "properties": {"ready": {"type": "boolean"},
                                                                "service_type": {"type": "string"}}}]},
    "Ready": {
        "type": "object",
        "required": ["status", "ready", "health", "service_type"],
        "properties": {
            "status": {"type": "string", "enum": ["ready", "not_ready"]},
            "ready": {"type": "boolean"},
            "health": {"type": "string", "enum": ["healthy", "degraded", "unhealthy"]},
            "service_type": {"type": "string"},
            "transport": {"type": "string"},
            "workers_total": {"type": "integer", "description": "as in Health"},
            "queued_sessions": {"type": "integer"},
        },
    },
    "Metadata": {"type": "object", "required": ["service_type", "transport", "pipeline_file", "queue_size",
                                                "session_capacity"],
                 "properties": {"service_type": {"type": "string"}, "transport": {"type": "string"},
                                "pipeline_file": {"type": "string"}, "queue_size": {"type": "integer"},
                                "session_capacity": {"type": "object"},
                                "control_idle_timeout": {**NULLABLE_NUM, "description": "seconds a "
                                                         "session may send no control before it steps aside; "
                                                         "null where it does not apply (a server-push pipeline "
                                                         "takes no controls), no worker has loaded the "
                                                         "pipeline yet, or workers run with different values"},
                                "session_inputs": {"type": ["array", "null"], "uniqueItems": True,
                                                   "items": {"type": "string", "enum": ["prompt", "image"]},
                                                   "description": "the inputs a create may give besides its "
                                                   "config, as the pipeline declares them (takes_prompt, "
                                                   "takes_image): 'image' is image_path or image_b64; another is a "
                                                   "400 invalid_input. null until a worker has loaded the "
                                                   "pipeline"},
                                "worker_settings": {"type": "object", "description": "per worker: the offered "
                                                    "settings its pipeline took (control_idle_timeout, fps), "
                                                    "with the values its sessions run with"},
                                "startup_check": {"type": "object", "description": "per worker: the startup "
                                                  "check (one warm-up chunk) passed or was skipped "
                                                  "(--skip-validation)"}}},
    "MetricsJson": {"type": "object", "required": ["service_type", "transport", "health", "serving"],
                    "properties": {"service_type": {"type": "string"}, "transport": {"type": "string"},
                                   "health": _ref("Health"), "serving": {"type": "object"}}},
}

SESSION_ID = {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}
FORBIDDEN_ORIGIN = "403"  # only a POST or DELETE is checked for the page it came from
COMMON_ERRORS = {"401": _error("missing or wrong API key (when one is configured)"),
                 FORBIDDEN_ORIGIN: _error("forbidden_origin: a POST or DELETE from a web page of another origin, not "
                                          "in --cors-allow-origins"),
                 "413": _error("request body too large"),
                 "503": _error("shutting_down: the server's stop has drained its sessions, and chunkline "
                               "stream-serve's front answers every request so, passing none on (plain hypercorn "
                               "closes them)")}
#: what every API route refuses before its own checks (``server.app``'s ``refuse_what_would_be_ignored``)
IGNORED_INPUT = ("a query parameter this route does not read (invalid_query), or a body on a GET or DELETE "
                 "(invalid_body)")


def _with_refusals_of_ignored_input(paths: dict[str, Any]) -> dict[str, Any]:
    """Every API route answers a 400 for input it would ignore, and only a POST or DELETE a 403 for its page's origin:
    the document listed neither 400 on most routes (a GET of /v1/service/health?x=1 answered an undocumented 400)
    and a 403 on GETs, which never answer one."""
    for path, item in paths.items():
        if path == "/":  # the demo page takes none of the API's rules
            continue
        for method, operation in item.items():
            responses = operation["responses"]
            if method == "get":
                responses.pop(FORBIDDEN_ORIGIN, None)
            own = responses.get("400")
            if own is None:
                responses["400"] = _error(IGNORED_INPUT)
            elif IGNORED_INPUT not in own["description"]:
                responses["400"] = {**own, "description": f"{own['description']}; or {IGNORED_INPUT}"}
    return paths


def openapi_document() -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/v1/stream/sessions": {
            "post": {
                "summary": "Create and admit a controller session",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("SessionCreateRequest")}}},
                "responses": {
                    "200": _json(_ref("SessionCreateResponse"), "assigned to a worker"),
                    "202": _json(_ref("SessionCreateResponse"), "queued; queue_position is its place"),
                    "400": _error("invalid request (field or pipeline option named in detail); invalid_input: a "
                                  "prompt, image_b64 or image_path given to a pipeline that does not take it; "
                                  "invalid_option: an option the pipeline refuses; invalid_image: an image_b64 or "
                                  "image_path the pipeline refuses (its check_image, named with the field)"),
                    "429": {**_error("no slot and no room in the queue, or the server is shutting down"),
                            "headers": {"Retry-After": {"schema": {"type": "integer"}}}},
                    "503": {**_error("no worker is running or starting, or none is ready to check the "
                                     "options or to say whether the pipeline takes the prompt or image given (the "
                                     "reason and when one may be back in Retry-After, left out when none will: every "
                                     "worker slot gave up or was drained), or the LiveKit server did not "
                                     "make the session's room (transport_unavailable)"),
                            "headers": {"Retry-After": {"schema": {"type": "integer"}}}},
                    **COMMON_ERRORS,
                },
            },
            "get": {
                "summary": "List sessions",
                "description": "Sessions oldest first, a page at a time: while more follow, `next` is the cursor "
                               "to pass as `after` for the next page.",
                "parameters": [{"name": "status", "in": "query", "required": False,
                                "schema": {"type": "string", "enum": STATUSES}},
                               {"name": "limit", "in": "query", "required": False,
                                "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIST_LIMIT, "default": LIST_LIMIT}},
                               {"name": "after", "in": "query", "required": False,
                                "schema": {"type": "string", "maxLength": 64},
                                "description": "the `next` of the page before (a cursor of this server run)"}],
                "responses": {"200": _json(_ref("SessionList"), "sessions"),
                              "400": _error("unknown status or query parameter, a limit out of range, a cursor that "
                                            "names no session of this server run (another run's, past the newest)"),
                              **COMMON_ERRORS},
            },
        },
        "/v1/stream/sessions/{session_id}": {
            "get": {"summary": "Read a session", "parameters": [SESSION_ID],
                    "responses": {"200": _json(_ref("SessionStatus"), "the session"), "404": _error("unknown session"),
                                  **COMMON_ERRORS}},
            "delete": {"summary": "Drain, close and release a session (idempotent once terminal)",
                       "parameters": [SESSION_ID],
                       "responses": {"200": _json(_ref("SessionDeleteResponse"), "its status after the drain"),
                                     "404": _error("unknown session"), **COMMON_ERRORS}},
        },
        "/v1/stream/sessions/{session_id}/tokens": {
            "post": {"summary": "Mint a viewer token (subscribe only)", "parameters": [SESSION_ID],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("TokenRequest")}}},
                     "responses": {"200": _json(_ref("TokenResponse"), "a viewer token"),
                                   "400": _error("invalid identity or body"), "404": _error("unknown session"),
                                   "409": _error("a session draining or ended (or the server shutting down), identity already "
                                                 "in use, or every viewer seat "
                                                 "taken (viewers in the room and viewer tokens handed out, not yet "
                                                 "used)"), **COMMON_ERRORS}},
        },
        "/v1/stream/health": {"get": {"summary": "Admission and worker health",
                                      "responses": {"200": _json(_ref("Health"), "health"), **COMMON_ERRORS}}},
        "/v1/service/health": {"get": {"summary": "Service health (200 while the server serves)",
                                       "responses": {"200": _json(_ref("ServiceHealth"), "health"),
                                                     "503": COMMON_ERRORS["503"]}}},
        "/v1/service/ready": {"get": {"summary": "Readiness probe",
                                      "responses": {"200": _json(_ref("Ready"), "ready"),
                                                    "503": _json(_ref("Ready"), "not ready yet (loading) or closing")}}},
        "/v1/service/workers/{worker_id}/drain": {
            "post": {
                "summary": "Drain a worker: no new sessions; live ones finish or are drained at the deadline",
                "parameters": [{"name": "worker_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "requestBody": {"required": False, "content": {"application/json": {"schema": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"deadline_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600}}}}}},
                "responses": {
                    "202": _json({"type": "object", "required": ["worker_id", "state", "deadline_seconds"],
                                  "properties": {"worker_id": {"type": "string"}, "state": {"type": "string"},
                                                 "deadline_seconds": {"type": "number"}}}, "draining"),
                    "400": _error("invalid deadline, or a field other than deadline_seconds"),
                    "401": _error("missing or wrong API key"),
                    "404": _error("unknown worker"),
                    "409": _error("the worker is still starting, already draining (the drain under way keeps "
                                  "its deadline), stopped or failed (nothing left to drain)"),
                    **COMMON_ERRORS,
                },
            }
        },
        "/v1/service/metadata": {"get": {"summary": "Topology, settings in force and the capacity plan",
                                         "responses": {"200": _json(_ref("Metadata"), "metadata")}}},
        "/v1/service/metrics": {"get": {"summary": "Prometheus metrics",
                                        "responses": {"200": {"description": "text exposition",
                                                              "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics at Prometheus's default scrape path (/v1/service/metrics)",
                             "responses": {"200": {"description": "text exposition",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/v1/service/metrics/json": {"get": {"summary": "Metrics as JSON",
                                             "responses": {"200": _json(_ref("MetricsJson"), "metrics")}}},
        "/openapi.json": {"get": {"summary": "This document",
                                  "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1")}}},
        "/": {"get": {"summary": "The browser demo page",
                      "responses": {"200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}},
                                    "404": _error("demo page not installed")}}},
    }
    _with_refusals_of_ignored_input(paths)
    return {
        "openapi": "3.1.0",
        "info": {"title": "chunkline stream server", "version": "0.1.0",
                 "description": "Admission, tokens and health for interactive streaming sessions. Rooms are joined "
                                "over LiveKit or, on the local transport, by WebSocket at /v1/rooms/{room}/ws?token=..."},
        "paths": paths,
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
