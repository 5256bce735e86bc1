"""The HTTP API of the stream server (server.app), beside the session routes: viewer tokens; health, readiness,
metadata and metrics; framework errors as JSON."""

from __future__ import annotations

import datetime

import jwt
import pytest
from livekit import api

from server.tokens import MAX_IDENTITY_LENGTH

from .conftest import (
    LIVEKIT_KEY,
    LIVEKIT_SECRET,
    GatedLoader,
    assert_error_body,
    livekit_settings,
    make_settings,
    serve,
    wait_ready,
)

SESSIONS = "/v1/stream/sessions"


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
               "workers_busy", "workers_starting", "workers_draining", "workers_failed", "workers_stopped",
               "queued_sessions", "retained_sessions", "shutting_down", "free_slots", "worker_restarts", "worker_slots",
               "workers"}


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


async def test_a_method_a_route_does_not_take_is_a_405_naming_the_ones_it_takes(served):
    """werkzeug's 405 said only "The method is not allowed for the requested URL.", with no Allow field (RFC 9110
    15.5.6 asks for one), and its 404 "If you entered the URL manually please check your spelling"."""
    status, body, response = await served.json("put", SESSIONS)
    assert status == 405 and body["error"] == "method_not_allowed", body
    allowed = {m.strip() for m in response.headers["Allow"].split(",")}
    assert {"GET", "POST"} <= allowed and "PUT" not in allowed, response.headers["Allow"]
    assert body["detail"].startswith(f"PUT is not a method of '{SESSIONS}'") and "GET" in body["detail"], body
    status, body, response = await served.json("post", "/v1/service/health")
    assert status == 405 and "POST" not in response.headers["Allow"] and "GET" in response.headers["Allow"]
    status, body, _ = await served.json("get", "/v1/nope")
    assert status == 404 and body["detail"].startswith("no route '/v1/nope'"), body
