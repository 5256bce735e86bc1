"""The HTTP API of the stream server (server.app): every route, status code and error body."""

from __future__ import annotations

import base64
import datetime
import json
import os

import jwt
import pytest
import trio
from livekit import api
from trio.testing import wait_all_tasks_blocked

from server.app import create_app
from server.tokens import MAX_IDENTITY_LENGTH

from .conftest import (
    API_KEY,
    LIVEKIT_KEY,
    LIVEKIT_SECRET,
    GatedLoader,
    assert_error_body,
    livekit_settings,
    make_settings,
    png_bytes,
    serve,
    toy_loader,
    wait_ready,
)

SESSIONS = "/v1/stream/sessions"
LIVE = {"assigned", "joining_room", "starting_pipeline", "running"}


# -- POST /v1/stream/sessions ------------------------------------------------------------------


async def test_create_assigned_returns_200_with_every_field(served):
    status, body, _ = await served.create("ctl-1", prompt="a quiet street", config={"continuous": True})
    assert status == 200, body
    assert set(body) == {"session_id", "room", "livekit_url", "transport", "websocket_path", "token", "worker_id",
                         "status", "expires_at", "queue_position"}
    assert body["status"] == "assigned"
    assert body["worker_id"] == served.worker_id
    assert body["queue_position"] is None
    assert body["transport"] == "local" and body["livekit_url"] is None
    assert body["websocket_path"] == f"/v1/rooms/{body['room']}/ws"
    assert body["session_id"] in body["room"]
    assert isinstance(body["expires_at"], float)
    verified = served.runtime.issuer.verify(body["token"], room=body["room"])
    assert (verified.identity, verified.role) == ("ctl-1", "controller")
    record = served.runtime.get(body["session_id"])
    assert record.prompt == "a quiet street" and record.config == {"continuous": True}


async def test_create_queued_returns_202_with_queue_position(worker_kind):
    async with serve(make_settings(max_sessions_per_worker=1, queue_size=3), workers=worker_kind) as s:
        assert (await s.create("a"))[0] == 200
        status, body, _ = await s.create("b")
        assert status == 202, body
        assert body["status"] == "queued"
        assert body["queue_position"] == 1
        assert body["worker_id"] is None
        assert body["token"]  # a queued session already has its room and controller token
        status, body, _ = await s.create("c")
        assert (status, body["status"], body["queue_position"]) == (202, "queued", 2)


async def test_create_rejected_returns_429_with_reason_and_retry_after(worker_kind):
    async with serve(make_settings(max_sessions_per_worker=1, queue_size=0), workers=worker_kind) as s:
        assert (await s.create("a"))[0] == 200
        status, body, response = await s.create("b")
        assert status == 429
        assert_error_body(status, body, "no_capacity")
        assert int(response.headers["Retry-After"]) > 0
        # a rejected session leaves no record behind
        assert len(list(s.runtime.registry)) == 1


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"\xff\xfe\x00", "invalid_json"),
        (b"", "invalid_body"),
        (b"[1, 2]", "invalid_body"),
        (b'"identity"', "invalid_body"),
        (b"null", "invalid_body"),
        # json.loads keeps the last of a repeated key without a word: the token was issued for "b"
        (b'{"identity": "a", "identity": "b"}', "duplicate_key"),
        (b'{"identity": "a", "config": {"chunks": 2, "chunks": 3}}', "duplicate_key"),
        # json.loads makes 1e400 an infinity, which no JSON can carry on
        (b'{"identity": "a", "config": {"fps": 1e400}}', "out_of_range"),
    ],
)
async def test_create_refuses_bodies_that_are_not_json_objects(served, raw, code):
    status, body, _ = await served.json("post", SESSIONS, data=raw, headers={"Content-Type": "application/json"})
    assert status == 400
    assert_error_body(status, body, code)
    if code == "duplicate_key":
        assert "appears twice in one object" in body["detail"] and ("'identity'" in body["detail"]
                                                                    or "'chunks'" in body["detail"]), body
    if code == "out_of_range":
        assert "'1e400' is too large for a float" in body["detail"], body
    assert len(list(served.runtime.registry)) == 0


@pytest.mark.parametrize(
    ("payload", "code", "named"),
    [
        ({}, "invalid_field", "identity"),
        ({"identity": ""}, "invalid_field", "identity"),
        ({"identity": 7}, "invalid_field", "identity"),
        ({"identity": "has space"}, "invalid_identity", "identity"),
        ({"identity": "slash/y"}, "invalid_identity", "identity"),
        ({"identity": "é"}, "invalid_identity", "identity"),
        ({"identity": "x" * (MAX_IDENTITY_LENGTH + 1)}, "invalid_identity", str(MAX_IDENTITY_LENGTH)),
        ({"identity": "a", "imagepath": "scene.png"}, "unknown_field", "imagepath"),
        ({"identity": "a", "role": "viewer"}, "invalid_field", "role"),
        ({"identity": "a", "role": "worker"}, "invalid_field", "role"),
        ({"identity": "a", "prompt": 3}, "invalid_field", "prompt"),
        # the rule a prompt sent in the room follows: a blank one was taken here and refused there
        ({"identity": "a", "prompt": "   "}, "invalid_field", "prompt must be non-empty text"),
        ({"identity": "a", "prompt": "\u200b\u200b\n"}, "invalid_field", "prompt must be non-empty text"),  # invisible only
        ({"identity": "a", "prompt": "a\u0000b"}, "invalid_field", "prompt holds a control character (0x00) at character 1"),
        ({"identity": "a", "prompt": "p" * 2001}, "invalid_field", "prompt is 2001 characters; at most 2000"),
        ({"identity": "a", "config": [1]}, "invalid_field", "config"),
        ({"identity": "a", "image_b64": "not base64!"}, "invalid_field", "image_b64"),
    ],
)
async def test_create_refuses_bad_fields_naming_them(served, payload, code, named):
    status, body, _ = await served.json("post", SESSIONS, json=payload)
    assert status == 400, body
    assert_error_body(status, body, code)
    assert named in body["detail"]
    assert len(list(served.runtime.registry)) == 0


async def test_identity_of_exactly_max_length_is_accepted(served):
    status, body, _ = await served.create("x" * MAX_IDENTITY_LENGTH)
    assert status == 200, body


async def test_image_path_needs_assets_dir(served):
    status, body, _ = await served.create("a", image_path="scene.png")
    assert status == 400
    assert_error_body(status, body, "image_path_not_allowed")


async def test_image_path_inside_assets_dir_is_resolved(assets_dir, worker_kind):
    async with serve(make_settings(assets_dir=str(assets_dir)), workers=worker_kind) as s:
        for relative, target in [("scene.png", "scene.png"), ("sub/deep.png", "sub/deep.png"),
                                 ("inside_link.png", "scene.png")]:
            status, body, _ = await s.create("a", image_path=relative)
            assert status == 200, body
            assert s.runtime.get(body["session_id"]).image_path == str((assets_dir / target).resolve())
            await s.json("delete", f"{SESSIONS}/{body['session_id']}")


@pytest.mark.parametrize(
    ("image_path", "why"),
    [
        ("/etc/passwd", "absolute"),
        ("ABSOLUTE", "absolute"),  # replaced by the assets dir's own absolute path
        ("../outside.png", "dotdot"),
        ("sub/../../outside.png", "dotdot"),
        ("escape.png", "symlink out"),
        ("missing.png", "nonexistent"),
        ("sub", "a directory"),
        ("sub\\deep.png", "backslash"),
    ],
)
async def test_image_path_outside_or_missing_is_refused(assets_dir, image_path, why, worker_kind):
    if image_path == "ABSOLUTE":
        image_path = str(assets_dir / "scene.png")
    async with serve(make_settings(assets_dir=str(assets_dir)), workers=worker_kind) as s:
        status, body, _ = await s.create("a", image_path=image_path)
        assert status == 400, (why, body)
        assert_error_body(status, body, "invalid_image_path")
        assert len(list(s.runtime.registry)) == 0


async def test_image_b64_upload_is_stored_then_deleted_when_the_session_ends(served):
    image = png_bytes(8, 6)
    status, body, _ = await served.create("a", image_b64=base64.b64encode(image).decode())
    assert status == 200, body
    record = served.runtime.get(body["session_id"])
    upload = record.upload_path
    assert upload is not None and record.image_path == upload
    with open(upload, "rb") as file:
        assert file.read() == image
    status, deleted, _ = await served.json("delete", f"{SESSIONS}/{body['session_id']}")
    assert (status, deleted["status"]) == (200, "closed")
    assert not os.path.exists(upload)


async def test_image_b64_upload_of_a_rejected_session_is_not_kept(worker_kind):
    async with serve(make_settings(max_sessions_per_worker=1, queue_size=0), workers=worker_kind) as s:
        assert (await s.create("a"))[0] == 200
        uploads_before = s.runtime.uploads.path and set(os.listdir(s.runtime.uploads.path))
        status, _, _ = await s.create("b", image_b64=base64.b64encode(png_bytes()).decode())
        assert status == 429
        if s.runtime.uploads.path is not None:
            assert set(os.listdir(s.runtime.uploads.path)) == (uploads_before or set())


async def test_image_path_and_image_b64_together_are_refused(assets_dir, worker_kind):
    async with serve(make_settings(assets_dir=str(assets_dir)), workers=worker_kind) as s:
        status, body, _ = await s.create("a", image_path="scene.png", image_b64=base64.b64encode(png_bytes()).decode())
        assert status == 400
        assert_error_body(status, body, "invalid_field")


async def test_body_above_max_body_bytes_gets_413(worker_kind):
    async with serve(make_settings(max_body_bytes=2048), workers=worker_kind) as s:
        payload = json.dumps({"identity": "a", "prompt": "p" * 1500, "config": {"pad": "x" * 1500}}).encode()
        assert len(payload) > 2048
        status, body, _ = await s.json("post", SESSIONS, data=payload, headers={"Content-Type": "application/json"})
        assert status == 413
        assert_error_body(status, body)
        assert "2048 bytes" in body["detail"] and "--max-body-bytes" in body["detail"], body  # the limit, by name
        assert len(list(s.runtime.registry)) == 0
        # just under the limit is fine
        status, body, _ = await s.create("a", prompt="p" * 1000)
        assert status == 200, body


# -- GET / list / DELETE ---------------------------------------------------------------------------


async def test_get_session_fields(served):
    _, created, _ = await served.create("a")
    await served.settle()
    status, body, _ = await served.json("get", f"{SESSIONS}/{created['session_id']}")
    assert status == 200
    assert set(body) == {"session_id", "room", "status", "worker_id", "pipeline_session_id", "created_at",
                         "updated_at", "expires_at", "participant_count", "queue_position", "error", "drain_cause"}
    assert body["session_id"] == created["session_id"] and body["room"] == created["room"]
    assert body["status"] == "joining_room"  # its runner waits for the controller
    assert body["participant_count"] == 0 and body["error"] is None and body["queue_position"] is None
    assert body["drain_cause"] is None


async def test_get_unknown_session_is_404_json(served):
    status, body, _ = await served.json("get", f"{SESSIONS}/nope")
    assert status == 404
    assert_error_body(status, body, "not_found")


async def test_get_shows_live_queue_position(worker_kind):
    async with serve(make_settings(max_sessions_per_worker=1, queue_size=3), workers=worker_kind) as s:
        _, first, _ = await s.create("a")
        ids = [(await s.create(f"q{i}"))[1]["session_id"] for i in range(3)]
        for position, session_id in enumerate(ids, 1):
            _, body, _ = await s.json("get", f"{SESSIONS}/{session_id}")
            assert (body["status"], body["queue_position"]) == ("queued", position)
        await s.json("delete", f"{SESSIONS}/{ids[0]}")
        _, body, _ = await s.json("get", f"{SESSIONS}/{ids[2]}")
        assert body["queue_position"] == 2
        await s.json("delete", f"{SESSIONS}/{first['session_id']}")
        await s.settle()
        _, body, _ = await s.json("get", f"{SESSIONS}/{ids[1]}")
        assert body["queue_position"] is None and body["status"] in LIVE
        _, body, _ = await s.json("get", f"{SESSIONS}/{ids[2]}")
        assert (body["status"], body["queue_position"]) == ("queued", 1)


async def test_list_sessions_and_status_filter(served):
    _, a, _ = await served.create("a")
    _, b, _ = await served.create("b")
    await served.json("delete", f"{SESSIONS}/{a['session_id']}")
    await served.settle()
    status, body, _ = await served.json("get", SESSIONS)
    assert status == 200
    assert {r["session_id"] for r in body["sessions"]} == {a["session_id"], b["session_id"]}
    _, closed, _ = await served.json("get", f"{SESSIONS}?status=closed")
    assert [r["session_id"] for r in closed["sessions"]] == [a["session_id"]]
    _, joining, _ = await served.json("get", f"{SESSIONS}?status=joining_room")
    assert [r["session_id"] for r in joining["sessions"]] == [b["session_id"]]
    _, running, _ = await served.json("get", f"{SESSIONS}?status=running")
    assert running["sessions"] == []


async def test_list_with_unknown_status_is_400(served):
    await served.create("a")
    status, body, _ = await served.json("get", f"{SESSIONS}?status=bogus")
    assert status == 400
    assert_error_body(status, body, "invalid_query")


async def test_list_with_unknown_status_is_400_even_when_empty(served):
    status, body, _ = await served.json("get", f"{SESSIONS}?status=bogus")
    assert status == 400, body
    assert_error_body(status, body, "invalid_query")


async def test_delete_is_idempotent_for_terminal_sessions(served):
    _, created, _ = await served.create("a")
    path = f"{SESSIONS}/{created['session_id']}"
    first = await served.json("delete", path)
    second = await served.json("delete", path)
    assert first[0] == second[0] == 200
    assert first[1] == second[1] == {"session_id": created["session_id"], "status": "closed"}
    _, body, _ = await served.json("get", path)
    assert body["status"] == "closed"


async def test_delete_unknown_is_404(served):
    status, body, _ = await served.json("delete", f"{SESSIONS}/nope")
    assert status == 404
    assert_error_body(status, body, "not_found")


# -- viewer tokens --------------------------------------------------------------------------------


async def test_viewer_token_grants_subscribe_only(worker_kind):
    async with serve(livekit_settings(), workers=worker_kind) as s:
        _, created, _ = await s.create("ctl")
        tokens = f"{SESSIONS}/{created['session_id']}/tokens"
        status, body, _ = await s.json("post", tokens, json={"identity": "viewer-1"})
        assert status == 200, body
        assert body["role"] == "viewer" and body["identity"] == "viewer-1"
        assert body["room"] == created["room"] and body["session_id"] == created["session_id"]
        assert body["livekit_url"] is None  # media on the local transport
        claims = api.TokenVerifier(LIVEKIT_KEY, LIVEKIT_SECRET, leeway=datetime.timedelta(0)).verify(body["token"])
        assert claims.identity == "viewer-1"
        assert claims.video.room == created["room"] and claims.video.room_join is True
        assert claims.video.can_subscribe is True
        assert claims.video.can_publish is False
        assert claims.video.can_publish_data is False
        raw = jwt.decode(body["token"], options={"verify_signature": False})
        assert raw["video"]["canPublishData"] is False and raw["video"]["canPublish"] is False
        assert raw["iss"] == LIVEKIT_KEY
        # the controller token is signed by the same key and may publish data
        controller = api.TokenVerifier(LIVEKIT_KEY, LIVEKIT_SECRET).verify(created["token"])
        assert controller.video.can_publish_data is True and controller.video.can_publish is False


async def test_viewer_token_with_the_dev_issuer(served):
    _, created, _ = await served.create("ctl")
    status, body, _ = await served.json("post", f"{SESSIONS}/{created['session_id']}/tokens", json={"identity": "v"})
    assert status == 200
    verified = served.runtime.issuer.verify(body["token"], room=created["room"])
    assert (verified.role, verified.identity) == ("viewer", "v")
    assert (verified.can_subscribe, verified.can_publish, verified.can_publish_data) == (True, False, False)


async def test_viewer_token_for_unknown_session_is_404(served):
    status, body, _ = await served.json("post", f"{SESSIONS}/nope/tokens", json={"identity": "v"})
    assert status == 404
    assert_error_body(status, body, "not_found")


async def test_viewer_token_for_terminal_session_is_409(served):
    _, created, _ = await served.create("ctl")
    await served.json("delete", f"{SESSIONS}/{created['session_id']}")
    status, body, _ = await served.json("post", f"{SESSIONS}/{created['session_id']}/tokens", json={"identity": "v"})
    assert status == 409
    assert_error_body(status, body, "conflict")


async def test_viewer_token_with_the_controllers_identity_is_409(served):
    _, created, _ = await served.create("ctl")
    status, body, _ = await served.json("post", f"{SESSIONS}/{created['session_id']}/tokens", json={"identity": "ctl"})
    assert status == 409
    assert_error_body(status, body, "conflict")


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        ({"identity": "bad id"}, "invalid_identity"),
        ({"identity": "v" * (MAX_IDENTITY_LENGTH + 1)}, "invalid_identity"),
        ({"identity": ""}, "invalid_field"),
        ({}, "invalid_field"),
        ({"identity": "v", "role": "controller"}, "invalid_field"),
        ({"identity": "v", "extra": 1}, "unknown_field"),
        ([], "invalid_body"),
    ],
)
async def test_viewer_token_bad_body_is_400(served, payload, code):
    _, created, _ = await served.create("ctl")
    status, body, _ = await served.json("post", f"{SESSIONS}/{created['session_id']}/tokens", json=payload)
    assert status == 400, body
    assert_error_body(status, body, code)


# -- health, readiness, metadata, metrics --------------------------------------------------------------


HEALTH_KEYS = {"status", "transport", "transport_connected", "livekit_connected", "workers_total", "workers_idle",
               "workers_busy", "workers_starting", "workers_failed", "queued_sessions", "retained_sessions", "free_slots",
               "worker_restarts", "worker_slots", "workers"}


async def test_stream_health(served):
    status, body, _ = await served.json("get", "/v1/stream/health")
    assert status == 200
    assert set(body) == HEALTH_KEYS
    assert body["status"] == "healthy" and body["workers_total"] == 1 and body["free_slots"] == 2
    await served.create("a")
    _, body, _ = await served.json("get", "/v1/stream/health")
    assert body["retained_sessions"] == 1 and body["free_slots"] == 1 and body["workers_busy"] == 1


@pytest.mark.in_process_only(reason="the worker's loading is held by an in-process loader object (GatedLoader); an agent "
                              "loads its pipeline in its own process, which the test cannot hold")
async def test_ready_is_503_until_the_worker_is_ready_and_health_is_always_200(worker_kind):
    loader = GatedLoader()
    async with serve(make_settings(), loader=loader, ready=False) as s:
        try:
            status, body, _ = await s.json("get", "/v1/service/ready")
            assert status == 503
            assert body["ready"] is False and body["service_type"] == "stream"
            status, body, _ = await s.json("get", "/v1/service/health")
            assert status == 200
            assert body["ready"] is False and body["service_type"] == "stream"
            assert body["workers_starting"] == 1 and body["status"] == "degraded"
            assert set(body) >= HEALTH_KEYS | {"ready", "service_type"}
        finally:
            loader.release()
        await wait_ready(s.runtime)
        status, body, _ = await s.json("get", "/v1/service/ready")
        assert status == 200 and body["ready"] is True
        status, body, _ = await s.json("get", "/v1/service/health")
        assert status == 200 and body["ready"] is True and body["status"] == "healthy"


@pytest.mark.in_process_only(reason="the worker's loading is held by an in-process loader object (GatedLoader); an agent "
                              "loads its pipeline in its own process, which the test cannot hold")
async def test_ready_body_status_says_ready_or_not_ready(worker_kind):
    """Reference B.2: ``{status: "ready"|"not_ready", ready, service_type, transport, ...health}``."""
    loader = GatedLoader()
    async with serve(make_settings(), loader=loader, ready=False) as s:
        try:
            _, before, _ = await s.json("get", "/v1/service/ready")
        finally:
            loader.release()
        await wait_ready(s.runtime)
        _, after, _ = await s.json("get", "/v1/service/ready")
    assert (before["status"], after["status"]) == ("not_ready", "ready")


async def test_metadata_reports_the_capacity_plan(served):
    status, body, _ = await served.json("get", "/v1/service/metadata")
    assert status == 200
    assert body["service_type"] == "stream" and body["transport"] == "local"
    assert body["pipeline_file"] == served.settings.pipeline
    assert body["pipeline_kind"] is not None
    assert body["max_sessions_per_worker"] == 2 and body["configured_max_sessions_per_worker"] == 2
    assert body["queue_size"] == 2
    plan = body["session_capacity"][served.worker_id]
    assert isinstance(plan, dict) and plan.get("effective_capacity") == 2
    assert body["worker_failures"] == {}


async def test_prometheus_metrics_and_alias(served):
    _, created, _ = await served.create("a")
    await served.json("post", f"{SESSIONS}/{created['session_id']}/tokens", json={"identity": "v"})
    responses = [await served.client.get(path) for path in ("/v1/service/metrics", "/metrics")]
    texts = []
    for response in responses:
        assert response.status_code == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        texts.append((await response.get_data()).decode())
    names = [set(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")) for text in texts]
    assert names[0] == names[1] and names[0]
    assert any(name.startswith("chunkline_") for name in names[0])
    assert all(name.startswith("chunkline_") for name in names[0]), sorted(names[0])
    for text in texts:
        assert created["session_id"] not in text and created["room"] not in text


async def test_metrics_json(served):
    status, body, _ = await served.json("get", "/v1/service/metrics/json")
    assert status == 200
    assert body["service_type"] == "stream" and body["transport"] == "local"
    assert set(body["health"]) == HEALTH_KEYS
    assert isinstance(body["serving"], dict)


# -- errors are JSON -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("get", "/v1/nope", 404),
        ("get", "/static/../server/app.py", 404),
        ("put", SESSIONS, 405),
        ("patch", f"{SESSIONS}/x", 405),
        ("post", "/v1/service/health", 405),
    ],
)
async def test_framework_errors_are_json(served, method, path, expected):
    status, body, response = await served.json(method, path)
    assert status == expected
    assert response.headers["Content-Type"].startswith("application/json")
    assert_error_body(status, body)


# -- API key -----------------------------------------------------------------------------------------------


async def test_api_key_guards_stream_routes_only(worker_kind):
    async with serve(make_settings(api_key=API_KEY), workers=worker_kind) as s:
        good = {"Authorization": f"Bearer {API_KEY}"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                        {"Authorization": f"bearer {API_KEY}x"}):
            for method, path in (("get", SESSIONS), ("post", SESSIONS), ("get", "/v1/stream/health"),
                                 ("get", f"{SESSIONS}/x"), ("delete", f"{SESSIONS}/x"),
                                 ("post", f"{SESSIONS}/x/tokens")):
                kwargs = {"json": {"identity": "a"}} if method == "post" else {}
                status, body, response = await s.json(method, path, headers=headers, **kwargs)
                assert status == 401, (method, path, headers)
                assert_error_body(status, body, "unauthorized")
                assert response.headers.get("WWW-Authenticate") == "Bearer"
        assert len(list(s.runtime.registry)) == 0
        status, body, _ = await s.json("post", SESSIONS, json={"identity": "a"}, headers=good)
        assert status == 200, body
        assert (await s.json("get", f"{SESSIONS}/{body['session_id']}", headers=good))[0] == 200
        assert (await s.json("get", "/v1/stream/health", headers=good))[0] == 200
        for path in ("/v1/service/health", "/v1/service/ready", "/v1/service/metadata", "/v1/service/metrics",
                     "/metrics", "/v1/service/metrics/json", "/openapi.json"):
            assert (await s.client.get(path)).status_code == 200, path


# -- CORS ----------------------------------------------------------------------------------------------------


async def test_no_cors_header_by_default(served):
    for method, path in (("get", "/v1/service/health"), ("get", SESSIONS), ("options", SESSIONS)):
        response = await getattr(served.client, method)(path, headers={"Origin": "http://a.example"})
        assert "Access-Control-Allow-Origin" not in response.headers, (method, path)


async def test_cors_echoes_only_an_allowed_origin(worker_kind):
    async with serve(make_settings(cors_allow_origins=("http://a.example",)), workers=worker_kind) as s:
        response = await s.client.get(SESSIONS, headers={"Origin": "http://a.example"})
        assert response.headers["Access-Control-Allow-Origin"] == "http://a.example"
        assert "Origin" in response.headers.get("Vary", "")
        response = await s.client.options(
            SESSIONS, headers={"Origin": "http://a.example", "Access-Control-Request-Method": "POST"}
        )
        assert response.status_code < 300
        assert response.headers["Access-Control-Allow-Origin"] == "http://a.example"
        assert "POST" in response.headers["Access-Control-Allow-Methods"]
        for other in ("http://b.example", "http://a.example.evil", "https://a.example"):
            response = await s.client.get(SESSIONS, headers={"Origin": other})
            assert "Access-Control-Allow-Origin" not in response.headers, other
        response = await s.client.get(SESSIONS)
        assert "Access-Control-Allow-Origin" not in response.headers


async def test_cors_wildcard_allows_any_origin(worker_kind):
    async with serve(make_settings(cors_allow_origins="*"), workers=worker_kind) as s:
        response = await s.client.get(SESSIONS, headers={"Origin": "http://anything.example"})
        assert response.headers.get("Access-Control-Allow-Origin") in ("*", "http://anything.example")


# -- secrets never leave the server ------------------------------------------------------------------------


async def test_no_response_contains_a_secret(assets_dir, worker_kind):
    settings = livekit_settings(api_key=API_KEY, assets_dir=str(assets_dir), max_sessions_per_worker=1, queue_size=1)
    secrets = (LIVEKIT_SECRET, API_KEY)
    async with serve(settings, workers=worker_kind) as s:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        seen: list[bytes] = []

        async def call(method: str, path: str, **kwargs) -> dict | None:
            response = await getattr(s.client, method)(path, **kwargs)
            data = await response.get_data()
            seen.append(data)
            seen.append(json.dumps(dict(response.headers)).encode())
            try:
                return json.loads(data)
            except ValueError:
                return None

        created = await call("post", SESSIONS, json={"identity": "a", "image_path": "scene.png"}, headers=auth)
        await call("post", SESSIONS, json={"identity": "b"}, headers=auth)
        await call("post", SESSIONS, json={"identity": "c"}, headers=auth)  # 429
        await call("post", SESSIONS, json={"identity": "a", "image_path": "../x"}, headers=auth)
        await call("post", SESSIONS, data=b"{", headers=auth)
        await call("get", SESSIONS, headers={"Authorization": "Bearer nope"})
        await call("get", SESSIONS, headers=auth)
        await call("get", f"{SESSIONS}/{created['session_id']}", headers=auth)
        await call("post", f"{SESSIONS}/{created['session_id']}/tokens", json={"identity": "v"}, headers=auth)
        for path in ("/v1/stream/health", "/v1/service/health", "/v1/service/ready", "/v1/service/metrics",
                     "/metrics", "/v1/service/metrics/json", "/openapi.json", "/v1/nope"):
            await call("get", path, headers=auth)
        metadata = await call("get", "/v1/service/metadata")
        await call("delete", f"{SESSIONS}/{created['session_id']}", headers=auth)
        assert metadata["livekit_url"] == "ws://127.0.0.1:7880"
        for data in seen:
            for secret in secrets:
                assert secret.encode() not in data
        # the token issuer uses the configured key: it is public, the secret is not
        assert s.runtime.issuer.api_key == LIVEKIT_KEY


async def test_no_response_contains_a_secret_on_the_livekit_transport(worker_kind):
    """transport=livekit (no LiveKit server runs here: the create is refused, as it cannot make the room)."""
    settings = livekit_settings(transport="livekit", api_key=API_KEY)
    async with serve(settings, workers=worker_kind) as s:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        bodies: list[bytes] = []
        for method, path, kwargs in [
            ("get", "/v1/service/metadata", {}), ("get", "/v1/service/health", {}), ("get", "/v1/service/ready", {}),
            ("get", "/v1/stream/health", {"headers": auth}), ("get", "/v1/service/metrics", {}),
            ("get", "/v1/service/metrics/json", {}), ("get", "/openapi.json", {}), ("get", SESSIONS, {}),
            ("post", SESSIONS, {"headers": auth, "json": {"identity": "a"}}),
        ]:
            response = await getattr(s.client, method)(path, **kwargs)
            bodies.append(await response.get_data())
            bodies.append(json.dumps(dict(response.headers)).encode())
        refused = json.loads(bodies[-2])
        assert refused["error"] == "transport_unavailable" and "ws://127.0.0.1:7880" in refused["detail"], refused
        for data in bodies:
            assert LIVEKIT_SECRET.encode() not in data and API_KEY.encode() not in data


# -- shutdown ---------------------------------------------------------------------------------------------------


@pytest.mark.in_process_only(reason="it drives an in-process app's ASGI lifespan through quart's test app; the shutdown "
                              "of an authority with agents is test_faults.py::test_sigterm_drains_live_sessions_and_exits_0[local]")
async def test_lifespan_shutdown_with_live_sessions_completes_and_closes_them(worker_kind):
    """The ASGI lifespan shutdown with a live and a queued session: it completes promptly and ends both."""
    settings = make_settings(max_sessions_per_worker=1, queue_size=1)
    app = create_app(settings, service_loader=toy_loader(1))
    runtime = app.extensions["chunkline"]
    test_app = app.test_app()
    test_app.shutdown_timeout = 3
    await test_app.__aenter__()
    try:
        client = test_app.test_client()
        await wait_ready(runtime)
        live = await (await client.post(SESSIONS, json={"identity": "a"})).get_json()
        queued = await (await client.post(SESSIONS, json={"identity": "b"})).get_json()
        await wait_all_tasks_blocked()
        assert runtime.get(live["session_id"]).status.value == "joining_room"
        try:
            await test_app.shutdown()
            completed = True
        except trio.TooSlowError:
            completed = False
    finally:
        await test_app._nursery_manager.__aexit__(None, None, None)
    assert completed, "the app never sent lifespan.shutdown.complete (its after_serving did not finish)"
    assert runtime.get(live["session_id"]).is_terminal
    assert runtime.get(queued["session_id"]).is_terminal
    assert not runtime.runners
