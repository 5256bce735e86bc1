"""The HTTP API of the stream server (server.app), its guards and shutdown: the API key, CORS, no response
carries a secret, and the lifespan shutdown with live sessions."""

from __future__ import annotations

import json

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from server.app import create_app

from .conftest import (
    API_KEY,
    LIVEKIT_KEY,
    LIVEKIT_SECRET,
    assert_error_body,
    livekit_settings,
    make_settings,
    serve,
    toy_loader,
    wait_ready,
)

SESSIONS = "/v1/stream/sessions"


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
