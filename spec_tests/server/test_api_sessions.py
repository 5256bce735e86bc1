"""The HTTP API of the stream server (server.app), the session routes: POST /v1/stream/sessions (200/202/429,
bad bodies and fields, images, 413) and GET, list and DELETE, with their status codes and error bodies."""

from __future__ import annotations

import base64
import json
import os

import pytest

from server.tokens import MAX_IDENTITY_LENGTH

from .conftest import assert_error_body, make_settings, png_bytes, serve

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
