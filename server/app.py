"""The quart-trio application: the seed's HTTP API, the local rooms' WebSocket, the demo page.

``create_app(settings)`` builds one app with its own runtime, token issuer,
transport and metrics registry. Every error is JSON ``{"error": code, "detail": text}``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import attrs
import trio
from quart import Response, has_request_context, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound, RequestTimeout
from werkzeug.routing import WebsocketMismatch

from . import json_limits, option_check, runtime_views
from .cluster.wire_values import MAX_DRAIN_SECONDS
from .http_framing import longest_body_seconds
from .log_pace import LogPace
from .loop_holds import loop_holds
from .metrics import CONTENT_TYPE, ServerMetrics
from .open_access import key_refusal, own_names, page_refusal
from .openapi import openapi_document
from .reasons import echo, echo_each
from .registry import UnknownCursor, UnknownStreamSession
from .requests import (BadRequest, Busy, check_image_decodes, parse_create_session, parse_drain_request, parse_list_query, parse_token_request,
                       resolve_image_path)
from .room_socket import Deadlines
from states.admission import UnknownWorker
from states.stream_session import State as SessionState

from .runtime import SHUTDOWN_GRACE, NoWorker, SessionConflict, StreamRuntime, ViewerLimit
from .runtime_errors import NO_WORKER_RETRY_AFTER
from .session_inputs import check_inputs
from .settings import ServerSettings
from .tokens import IdentityError, ReservedIdentity, TokenIssuer, TokenRejected
from .transport.base import TransportError
from .transport.local import LocalRooms, RemoteWorkerPresence

__all__ = ["create_app"]

log = logging.getLogger("chunkline.server")

STATIC = Path(__file__).parent / "static"
DRAIN_DEADLINE = 30.0
MAX_DRAIN_DEADLINE = MAX_DRAIN_SECONDS  # one bound for a drain, through the API, the wire and the worker command
SESSION_STATUSES = frozenset(state.value for state in SessionState)  # what ?status= of the session list may name
API_PREFIXES = ("/v1/", "/metrics", "/openapi.json")  # the routes whose requests are checked whole
RETRY_AFTER_SECONDS = 5
MAX_STATIC_NAME = 255  # characters of a static file's path (longer names are a 404, not an OS error)
REFUSALS = {
    "no_capacity": "no retained slot is free and the queue is disabled",
    "queue_full": "no retained slot is free and the queue is full",
    "shutting_down": "the server is shutting down and admits no new session",
}


def error(status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> Response:
    response = Response(json.dumps({"error": code, "detail": detail}), status=status, mimetype="application/json")
    for name, value in (headers or {}).items():
        response.headers[name] = value
    return response


def _closes_after_its_last_byte(asgi_app: Any) -> Any:
    """The app with each HTTP response's last send shielded from the app's own cancellation.

    quart-trio cancels a request's tasks as soon as hypercorn reports the client's side done, and for a
    request that asked for ``Connection: close`` (every HTTP/1.0 one, too) hypercorn closes the connection
    from inside that last send: cancelled there, it left the connection open until its 30 s read timeout, so a
    client reading to the end waited 30 s and the server held the connection as long."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def send_last_shielded(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):  # bounded: hypercorn's own writes are shielded already
                    await send(message)
            else:
                await send(message)

        await asgi_app(scope, receive, send_last_shielded if scope["type"] == "http" else send)

    return app


def _make_transport(settings: ServerSettings, issuer: TokenIssuer) -> Any:
    if settings.transport == "livekit":
        from .transport.livekit import LiveKitTransport

        return LiveKitTransport(
            settings.livekit_url or "", api_key=settings.livekit_api_key, api_secret=settings.livekit_api_secret,
        )
    return LocalRooms(issuer, max_data_message_bytes=settings.max_data_message_bytes)


def create_app(settings: ServerSettings, *, service_loader: Any = None, restart_policy: Any = None) -> QuartTrio:
    app = QuartTrio(__name__, static_folder=None)
    app.asgi_app = _closes_after_its_last_byte(app.asgi_app)  # type: ignore[method-assign]
    app.url_map.merge_slashes = False  # "//" in a path is a 404 with a JSON reason, not a redirect to a merged path
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    head_grace = Deadlines().head  # Quart cut bodies at 60 s (1.25 MB at 20 KiB/s at 98 %): the front's rate bounds
    app.config["BODY_TIMEOUT"] = longest_body_seconds(settings.max_body_bytes, head_grace)
    if settings.livekit_api_key and settings.livekit_api_secret:
        issuer = TokenIssuer(settings.livekit_api_key, settings.livekit_api_secret, settings.token_ttl)
    else:
        issuer = TokenIssuer.dev(ttl_seconds=settings.token_ttl)
    metrics = ServerMetrics()
    transport = _make_transport(settings, issuer)
    room_failures = LogPace(log)
    runtime = StreamRuntime(
        settings, issuer=issuer, transport=transport, metrics=metrics, service_loader=service_loader,
        restart_policy=restart_policy,
    )
    app.extensions["chunkline"] = runtime
    if isinstance(transport, LocalRooms):  # a room opens only while its session lives, and closes when it ends

        def room_open(room: str) -> bool:
            record = runtime.registry.in_room(room)
            return record is not None and not record.is_terminal

        transport.room_open = room_open
        transport.viewer_door = runtime.viewer_seats.door  # a viewer takes a seat as it joins (server/viewer_seats.py)
        metrics.watch_room_backlog(lambda: transport.backlog.queued)  # the queued-text budget's count, at each scrape
        transport.on_refused = metrics.record_room_refusal
    runtime.lifecycle.on_terminal = lambda record, last_word, told: transport.close_room(record.room, last_word,
                                                                                         worker_told=told)
    public_url = settings.livekit_url if settings.transport == "livekit" else None

    @app.before_serving
    async def start() -> None:
        if hasattr(transport, "run"):  # LiveKit: its trio-asyncio loop lives for the app's lifetime
            await app.nursery.start(transport.run)
        await app.nursery.start(runtime.run)
        if settings.public_url:  # agents may join the local rooms before any request comes in
            runtime.serving_at(settings.public_url)

    @app.after_serving
    async def stop() -> None:
        # quart-trio may already be cancelling the app nursery: the drain must still run
        with trio.CancelScope(shield=True):
            await runtime.shutdown(SHUTDOWN_GRACE)

    # -- cross-cutting: API key, CORS, errors --------------------------------------

    @app.before_request
    async def read_body_first() -> None:
        # Read every request body before anything can answer: quart-trio may stall a
        # keep-alive connection whose previous request was answered with its body unread.
        if request.method in ("POST", "PUT", "PATCH", "DELETE"):  # a declared length is due at the front's rate
            declared = request.content_length  # (under plain hypercorn: BODY_TIMEOUT held 1 byte for 522 s)
            due = math.inf if declared is None else longest_body_seconds(declared, head_grace)
            with loop_holds().after(due) as late:  # a held loop is not the client's
                await request.get_data(cache=True)
            if late.cancelled_caught:
                raise RequestTimeout("the request body did not arrive within its deadline")

    page_names = None if settings.api_key else own_names(settings.host, settings.public_url)

    @app.before_request
    async def refuse_other_pages() -> Response | None:
        """A browser sends a page's POST here without asking first when it looks like a form: with no API key, a page
        anywhere drained the workers of whoever visited it. A request naming another page, in any Origin, is a 403."""
        origin = ", ".join(request.headers.getlist("Origin")) or None
        if request.method in ("GET", "HEAD", "OPTIONS") or origin is None:
            return None
        why = page_refusal(origin, request.headers.get("Host"), settings.cors_allow_origins, page_names)
        if why is None:
            return None
        return error(403, "forbidden_origin", f"a web page at {echo(origin)} may not call this server from a browser "
                                              f"({why})")

    @app.before_request
    async def learn_where_it_serves() -> None:
        """Under plain hypercorn the app is never told where it listens, and the agents of a cluster were refused
        for good ("does not know its rooms URL"): the first request's own address (the socket it came in on, never
        its Host header, which the client writes) is where they join the local rooms, unless --public-url says."""
        if request.scheme == "http" and request.server is not None and request.server[1] is not None:
            runtime.first_served_at(*request.server)

    @app.before_request
    async def require_api_key() -> Response | None:
        if request.method == "OPTIONS":
            return None
        if request.path.startswith("/v1/stream/"):
            return unauthorized()
        return None

    @app.before_request
    async def refuse_what_would_be_ignored() -> Response | None:
        """A query parameter or a body a route does not read is a 400 naming it: ``POST /v1/stream/sessions?foo=1``
        created a session and ``DELETE`` with a body closed one, each ignoring what it was given. The session list
        reads its own query (``parse_list_query``); the demo page and its files take none of the API's rules."""
        if request.method == "OPTIONS" or not request.path.startswith(API_PREFIXES):
            return None
        if request.routing_exception is not None:  # no route takes it (a 404, a 405, a room's path over plain HTTP)
            return None
        if request.args and not (request.method == "GET" and request.path == "/v1/stream/sessions"):
            names = echo_each(sorted(set(request.args.keys())))
            return error(400, "invalid_query", f"this route takes no query parameters; got {names}")
        if request.method in ("GET", "DELETE") and (request.content_length or await request.get_data(cache=True)):
            return error(400, "invalid_body", f"a {request.method} request here takes no body")
        return None

    def unauthorized() -> Response | None:
        """A 401 unless the request carries the API key, or none is set."""
        if not settings.api_key:
            return None
        if (fault := key_refusal(request.headers.get("Authorization"), settings.api_key)) is None:
            return None
        return error(401, "unauthorized", f"{fault}: this route needs 'Authorization: Bearer <api key>'",
                     {"WWW-Authenticate": "Bearer"})

    @app.after_request
    async def cors(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if origin and (origin in settings.cors_allow_origins or "*" in settings.cors_allow_origins):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
            response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
        return response

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        code = (exc.name or "error").lower().replace(" ", "_")
        asked = request if has_request_context() else websocket  # a handshake has no request (it was a 500 here)
        if exc.code == 413:
            # answered before the body was read: the connection closes rather than read the rest
            # of an over-large body (or hang a keep-alive client waiting behind it)
            detail = (f"the request body is larger than this server takes ({settings.max_body_bytes} bytes: "
                      f"--max-body-bytes)")
            return error(413, code, detail, {"Connection": "close"})
        if isinstance(exc, WebsocketMismatch) and asked is websocket:  # a handshake to a route that takes HTTP
            return error(404, "not_found", f"no WebSocket at {echo(asked.path)} (a room's is /v1/rooms/{{room}}/ws)")
        if isinstance(exc, WebsocketMismatch):  # werkzeug's words were "the browser (or proxy) sent a request that
            # this server could not understand", naming nothing
            return error(400, "bad_websocket_handshake", f"{echo(asked.path)} is a room's WebSocket: open it with a "
                                                         "WebSocket handshake (GET, Upgrade: websocket), the room's "
                                                         "token in ?token=")
        if isinstance(exc, MethodNotAllowed):  # werkzeug's words named neither the method nor those allowed, and its
            # Allow field (RFC 9110 15.5.6) was dropped with its body
            allowed = ", ".join(sorted(exc.valid_methods or ()))
            return error(405, code, f"{asked.method} is not a method of {echo(asked.path)}; it takes {allowed}",
                         {"Allow": allowed})
        if isinstance(exc, NotFound):  # werkzeug's words ("If you entered the URL manually...") named nothing
            return error(404, code, f"no route {echo(asked.path)} (the API's routes are listed at /openapi.json)")
        return error(exc.code or 500, code, exc.description or code)

    @app.errorhandler(BadRequest)
    async def bad_request(exc: BadRequest) -> Response:
        return error(exc.status, exc.code, exc.detail,
                     {"Retry-After": str(exc.retry_after)} if isinstance(exc, Busy) else None)

    @app.errorhandler(IdentityError)
    async def bad_identity(exc: IdentityError) -> Response:
        return error(400, "reserved_identity" if isinstance(exc, ReservedIdentity) else "invalid_identity", str(exc))

    @app.errorhandler(NoWorker)
    async def no_worker(exc: NoWorker) -> Response:
        retry = None if exc.retry_after is None else {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
        return error(503, "no_worker", str(exc), retry)

    @app.errorhandler(ViewerLimit)
    async def viewer_limit(exc: ViewerLimit) -> Response:
        return error(409, "viewer_limit", str(exc))

    @app.errorhandler(UnknownStreamSession)
    async def unknown_session(exc: UnknownStreamSession) -> Response:
        return error(404, "not_found", f"no session {echo(exc.args[0])}")

    @app.errorhandler(SessionConflict)
    async def conflict(exc: SessionConflict) -> Response:
        return error(409, "conflict", str(exc))

    @app.errorhandler(Exception)
    async def internal(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error(500, "internal_error", f"{type(exc).__name__}")

    async def json_body() -> Any:
        raw = await request.get_data(cache=True)
        if not raw:
            raise BadRequest("invalid_body", "the request body must be a JSON object")
        try:
            return json_limits.loads(raw)
        except json_limits.JsonRefused as exc:
            raise BadRequest(exc.reason, f"the request body: {exc.detail}") from None

    # -- sessions -------------------------------------------------------------------

    def session_view(record: Any) -> dict[str, Any]:
        return record.public(queue_position=runtime.queue_position(record))

    @app.post("/v1/stream/sessions")
    async def create_session() -> Response:
        # an input the pipeline does not take is a 400 now, before an uploaded image is decoded
        body, image = parse_create_session(
            await json_body(), lambda request, image_b64: check_inputs(runtime, request, image_b64, settings.pipeline))
        if body.image_path is not None:
            path, size = resolve_image_path(body.image_path, settings.assets_dir)
            body = attrs.evolve(body, image_path=path, image=size)
        if runtime.cluster is not None:  # the image goes to its agent in one message, so it is bounded
            from .cluster.remote import MAX_IMAGE_BYTES

            size = len(image) if image is not None else os.path.getsize(body.image_path) if body.image_path else 0
            if size > MAX_IMAGE_BYTES:
                raise BadRequest("image_too_large",
                                 f"the image has {size} bytes; worker agents take images of at most {MAX_IMAGE_BYTES}")
        # the book says now whether a session could be taken or queued: a create it would refuse (the queue full,
        # the server shutting down, no worker at all) gets that answer at once, with no decode of its image (up to
        # ~0.5 s of CPU) and no check of its options spent on it; no await until create_session gives the refusal
        if runtime.would_take_session():
            with runtime.checks_before_booking.scope():  # a stop cuts them short: create_session refuses at once
                await check_image_decodes(body, image, runtime.image_decodes)
                # a bad option, or an image the pipeline does not take, is a 400 before anything is held
                await option_check.check_options(runtime, body.config, body.image)
        named = runtime.new_session()
        # LiveKit: the room is made before its first token is out, and only then can it be refused; a create that
        # is refused at once (no slot, no place in the queue, no worker; or every place promised to the creates
        # whose rooms are being made) makes none: it is refused with no await between that look and the refusal
        if runtime.would_take_session():
            try:
                with runtime.opening_room():
                    await transport.open_room(named[1], lifetime=settings.session_timeout)
            except TransportError as exc:
                room_failures.warning("POST /v1/stream/sessions: %s", exc)  # as often as clients ask: paced
                return error(503, "transport_unavailable", str(exc), {"Retry-After": str(RETRY_AFTER_SECONDS)})
        try:
            created = runtime.create_session(body, image_bytes=image, named=named)
        except BaseException:  # no session holds the room (NoWorker, a bug): it goes now
            transport.close_room(named[1])
            raise
        admission = created.admission
        if admission.status == "rejected":
            reason = admission.reason or "no_capacity"
            if reason == "no_capacity" and not option_check.ready_workers(runtime):  # not full: none is ready
                said = runtime_views.services_said_failed(runtime)  # a failing worker was said to be starting
                raise NoWorker(f"no worker can take a session now ({said})" if said else "no worker has loaded the "
                               "pipeline yet (every worker is starting)", NO_WORKER_RETRY_AFTER)
            return error(429, reason, REFUSALS.get(reason, reason), {"Retry-After": str(RETRY_AFTER_SECONDS)})
        record = created.record
        payload = {
            "session_id": record.session_id,
            "room": record.room,
            "livekit_url": public_url,
            "transport": transport.name,
            "websocket_path": room_socket_path(record.room),
            "token": created.token,
            "worker_id": record.worker_id,
            "status": record.status.value,
            "expires_at": record.expires_at,
            "queue_position": runtime.queue_position(record),
        }
        return Response(json.dumps(payload), status=200 if admission.status == "assigned" else 202,
                        mimetype="application/json")

    @app.get("/v1/stream/sessions")
    async def list_sessions() -> dict[str, Any]:
        query = parse_list_query(request.args, SESSION_STATUSES)
        status = None if query.status is None else SessionState(query.status)
        try:
            records, following = runtime.registry.page(after=query.after, limit=query.limit, status=status)
        except UnknownCursor as exc:
            raise BadRequest("invalid_query", str(exc)) from None
        return {"sessions": [session_view(r) for r in records], "next": following}

    @app.get("/v1/stream/sessions/<session_id>")
    async def get_session(session_id: str) -> dict[str, Any]:
        return session_view(runtime.get(session_id))

    @app.delete("/v1/stream/sessions/<session_id>")
    async def delete_session(session_id: str) -> dict[str, Any]:
        record = await runtime.delete_session(session_id)
        return {"session_id": record.session_id, "status": record.status.value}

    def room_socket_path(room: str) -> str | None:
        """Where a token's holder joins the room: the server's own room socket (local rooms), or LiveKit (None)."""
        return f"/v1/rooms/{room}/ws" if transport.name == "local" else None

    @app.post("/v1/stream/sessions/<session_id>/tokens")
    async def viewer_token(session_id: str) -> dict[str, Any]:
        record = runtime.get(session_id)  # 404 before body errors
        identity = parse_token_request(await json_body())
        present = await runtime.room_follow.look_now(record)  # LiveKit: who is in the room now, for this check
        token = runtime.viewer_token(session_id, identity, present)
        record = runtime.get(session_id)
        return {"session_id": session_id, "room": record.room, "livekit_url": public_url, "transport": transport.name,
                "websocket_path": room_socket_path(record.room), "token": token, "role": "viewer", "identity": identity}

    # -- health, metadata, metrics ------------------------------------------------------

    @app.get("/v1/stream/health")
    async def stream_health() -> dict[str, Any]:
        return runtime.health()

    def service_health() -> dict[str, Any]:
        return {"ready": runtime.ready, "service_type": "stream", **runtime.health()}

    @app.get("/v1/service/health")
    async def health() -> dict[str, Any]:
        return service_health()

    @app.get("/v1/service/ready")
    async def ready() -> Response:
        body = {**service_health(), "health": runtime.health()["status"],
                "status": "ready" if runtime.ready else "not_ready"}
        return Response(json.dumps(body), status=200 if runtime.ready else 503, mimetype="application/json")

    @app.get("/v1/service/metadata")
    async def metadata() -> dict[str, Any]:
        return runtime.metadata()

    @app.get("/v1/service/metrics")
    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.prometheus_text(), status=200, content_type=CONTENT_TYPE)

    @app.get("/v1/service/metrics/json")
    async def metrics_json() -> dict[str, Any]:
        return {"service_type": "stream", "transport": transport.name, "health": runtime.health(),
                "serving": metrics.summary()}

    @app.post("/v1/service/workers/<worker_id>/drain")
    async def drain_worker(worker_id: str) -> Response:
        if (refused := unauthorized()) is not None:
            return refused
        raw = await request.get_data(cache=True)
        deadline = DRAIN_DEADLINE
        if raw:
            deadline = parse_drain_request(await json_body(), DRAIN_DEADLINE, MAX_DRAIN_DEADLINE)
        try:
            return Response(json.dumps(runtime.drain_worker(worker_id, deadline)), status=202,
                            mimetype="application/json")
        except UnknownWorker:
            return error(404, "not_found", f"no worker {echo(worker_id)}")

    @app.get("/openapi.json")
    async def openapi() -> dict[str, Any]:
        return openapi_document()

    # -- the local rooms and the demo page --------------------------------------------------

    @app.websocket("/v1/rooms/<room>/ws")
    async def room_socket(room: str) -> None:
        if not isinstance(transport, LocalRooms):
            await websocket.close(1008, "this server uses LiveKit rooms")
            return
        await websocket.accept()  # a refusal is told over the socket, then closed with its code
        try:
            subscriber = transport.admit_at_door(room, websocket.args.getlist("token"))
            # a worker agent publishing from its own process, or a browser
            serve = transport.serve_worker if isinstance(subscriber, RemoteWorkerPresence) else transport.serve_client
            await serve(room, subscriber, websocket.send, websocket.receive)  # type: ignore[arg-type]
        except TokenRejected as exc:  # at the door, or by the room just after it: one refusal
            await websocket.send(exc.refusal())
            await websocket.close(4401, exc.reason)

    @app.get("/")
    async def index() -> Response:
        page = STATIC / "index.html"
        if not page.is_file():
            return error(404, "not_found", "the demo page is not installed")
        return Response(page.read_text(), mimetype="text/html")

    @app.get("/static/<path:name>")
    async def static_file(name: str) -> Response:
        root = STATIC.resolve()
        missing = error(404, "not_found", f"no static file {echo(name)}")
        if len(name) > MAX_STATIC_NAME or "\x00" in name:
            return missing
        try:
            path = (root / name).resolve()
            if not path.is_relative_to(root) or not path.is_file():
                return missing
        except (OSError, ValueError):  # a component too long for the file system, a loop of links
            return missing
        kinds = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".png": "image/png"}
        return Response(path.read_bytes(), mimetype=kinds.get(path.suffix, "application/octet-stream"))

    return app

