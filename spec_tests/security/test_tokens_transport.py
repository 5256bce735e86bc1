"""Tokens and grants on the local transport's WebSocket (``/v1/rooms/{room}/ws?token=...``).

The server is configured with known LiveKit credentials (they sign every token), so the tests mint
forged, expired, other-room and wrong-role tokens themselves. For each bad token the socket gets one
``{"type": "refused", "reason": ..., "detail": ...}`` message and is closed, and the room is unchanged: same
participants, no new room, nothing delivered to the pipeline. Within a room, grants are enforced per
message: a viewer's data and anyone's binary frames are refused *and answered* on the same socket,
which stays open; a second connection with an identity already present is refused.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import jwt
import pytest
import trio
from quart.testing.connections import WebsocketDisconnectError
from trio.testing import wait_all_tasks_blocked

from server.tokens import TokenIssuer
from spec_tests.server.runner_fixtures import (
    CounterService,
    Peer,
    Served,
    join,
    make_issuer,
    serve,
    settings,
)

OTHER_SECRET = "an-attacker-secret-0123456789abcdef-xyz"  # >= 32 bytes, not the server's
WAIT = 20.0  # seconds: real-time waits (JPEG encoding runs in threads)


@asynccontextmanager
async def running_room() -> AsyncIterator[tuple[Served, CounterService, dict[str, Any], Peer]]:
    """A session whose controller is connected and whose pipeline session runs."""
    service = CounterService(fps=20, frames_per_chunk=2, size=(8, 8))
    async with serve(settings(max_sessions_per_worker=2), service) as served:
        created = await served.create("ctl")
        async with join(served, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "the session to run", timeout=WAIT)
            yield served, service, created, ctl


def pipeline_controls(service: CounterService) -> list[Any]:
    (session,) = service.sessions.values()
    return list(session.controls)


async def wait_for_a_control(service: CounterService) -> None:
    """Wait until a control reaches the pipeline session (the service signals each one), at most WAIT s."""
    (session,) = service.sessions.values()
    with trio.fail_after(WAIT):
        await session.wait_for(lambda taken: bool(taken.controls))


def tampered(token: str, **claims: Any) -> str:
    """The same signature over a payload with ``claims`` changed."""
    header, payload, signature = token.split(".")
    data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    data.update(claims)
    body = base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()
    return f"{header}.{body}.{signature}"


def unsigned(token: str) -> str:
    """The token's claims re-encoded with ``alg: none`` and no signature."""
    claims = jwt.decode(token, options={"verify_signature": False})
    header = base64.urlsafe_b64encode(b'{"alg":"none","typ":"JWT"}').rstrip(b"=").decode()
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{header}.{body}."


def bad_token(kind: str, served: Served, room: str, other_room: str) -> tuple[str | None, set[str]]:
    """A token of ``kind`` and the refusal reasons that may answer it."""
    good = served.runtime.issuer.controller_token(room, "intruder")
    if kind == "forged":  # right key id, wrong secret
        return make_issuer(secret=OTHER_SECRET).controller_token(room, "intruder"), {"bad_signature"}
    if kind == "forged_other_key":
        return TokenIssuer("another-key", OTHER_SECRET, 3600).controller_token(room, "intruder"), {"bad_signature"}
    if kind == "expired":
        return make_issuer(clock=lambda: time.time() - 7200).controller_token(room, "intruder"), {"expired"}
    if kind == "expired_by_a_second":
        return make_issuer(clock=lambda: time.time() - 3601).controller_token(room, "intruder"), {"expired"}
    if kind == "other_room":
        return served.runtime.issuer.controller_token(other_room, "intruder"), {"wrong_room"}
    if kind == "tampered_room":
        return tampered(served.runtime.issuer.controller_token(other_room, "intruder"),
                        video={"room": room, "roomJoin": True, "canPublish": True, "canPublishData": True,
                               "canSubscribe": True}), {"bad_signature"}
    if kind == "tampered_identity":
        return tampered(good, sub="ctl"), {"bad_signature"}
    if kind == "alg_none":
        return unsigned(good), {"malformed", "bad_signature"}
    if kind == "worker_role":
        return served.runtime.issuer.worker_token(room, "fake-worker"), {"wrong_role"}
    if kind == "garbage":
        return "not.a.jwt", {"malformed"}
    if kind == "random_bytes":
        return base64.urlsafe_b64encode(bytes(range(64))).decode(), {"malformed"}
    if kind == "empty":
        return "", {"malformed"}
    if kind == "missing":
        return None, {"malformed"}
    if kind == "duplicated":  # two ?token= in the room's URL, both valid: which is meant?
        return f"{good}&token={good}", {"malformed"}
    raise AssertionError(kind)


BAD_TOKENS = ["forged", "forged_other_key", "expired", "expired_by_a_second", "other_room", "tampered_room",
              "tampered_identity", "alg_none", "worker_role", "garbage", "random_bytes", "empty", "missing",
              "duplicated"]
#: what the refusal's detail says, where one kind of token has one cause (a bare "malformed" said nothing)
DETAILS = {"empty": "no token", "missing": "no token", "garbage": "does not decode", "random_bytes": "does not decode",
           "duplicated": "given 2 times", "expired": "expired", "other_room": "another room"}


async def assert_refused_and_closed(peer: Peer, reasons: set[str], detail: str = "") -> str:
    with trio.fail_after(WAIT):
        await peer.reader_done.wait()
    texts = peer.texts()
    assert len(texts) == 1 and texts[0]["type"] == "refused", texts
    assert texts[0]["reason"] in reasons, texts
    assert isinstance(texts[0]["detail"], str) and detail in texts[0]["detail"], texts
    assert isinstance(peer.closed_with, WebsocketDisconnectError), peer.closed_with
    assert peer.closed_with.args == (4401,), peer.closed_with  # a refusal's close code, wherever it was found
    return texts[0]["reason"]


@pytest.mark.parametrize("kind", BAD_TOKENS)
async def test_bad_tokens_are_refused_and_the_room_is_unchanged(kind: str) -> None:
    async with running_room() as (served, service, created, ctl):
        room = created["room"]
        other = await served.create("other-ctl")
        token, reasons = bad_token(kind, served, room, other["room"])
        transport = served.runtime.transport
        before = (transport.participants(room), set(transport.room_names()),
                  set(served.runtime.get(created["session_id"]).participants))
        joined_before = len([m for m in ctl.texts() if m["type"] == "participant_joined"])
        async with join(served, room, token) as intruder:
            reason = await assert_refused_and_closed(intruder, reasons, DETAILS.get(kind, ""))
            # counted for the operator, by reason, as every refusal a room sends (the door's were not)
            assert f'chunkline_room_refusals_total{{reason="{reason}"}} 1.0' in await served.metrics_text()
            # whatever the intruder still writes on the closed socket reaches nobody (checked below)
            with contextlib.suppress(Exception):
                await intruder.control({"type": "control_state", "controls": ["w"]})
        await wait_all_tasks_blocked()
        after = (transport.participants(room), set(transport.room_names()),
                 set(served.runtime.get(created["session_id"]).participants))
        assert after == before
        assert "intruder" not in after[0]
        assert pipeline_controls(service) == []
        assert len([m for m in ctl.texts() if m["type"] == "participant_joined"]) == joined_before
        assert (await served.get(created["session_id"]))["status"] == "running"


async def test_a_token_for_a_room_that_does_not_exist_creates_no_room() -> None:
    async with running_room() as (served, service, created, ctl):
        rooms = set(served.runtime.transport.room_names())
        forged = make_issuer(secret=OTHER_SECRET).controller_token("chunkline-made-up", "intruder")
        async with join(served, "chunkline-made-up", forged) as intruder:
            await assert_refused_and_closed(intruder, {"bad_signature"})
        assert set(served.runtime.transport.room_names()) == rooms


async def test_a_viewer_sending_control_is_refused_and_answered() -> None:
    async with running_room() as (served, service, created, ctl):
        token = await served.viewer_token(created["session_id"], "watcher")
        async with join(served, created["room"], token) as viewer:
            await viewer.wait_for(lambda p: any(m["type"] == "joined" for m in p.texts()), "joined", timeout=WAIT)
            await viewer.control({"type": "control_state", "controls": ["w", "d"]})
            await viewer.control({"type": "stop"})
            await viewer.send("tf.status", {"type": "done"})  # spoofing the worker's topic is data too
            await viewer.ws.send(b"V\xff\xd8fake-frame")
            refused = await viewer.wait_for(
                lambda p: (lambda r: r if len(r) >= 4 else None)([m for m in p.texts() if m["type"] == "refused"]),
                "four refusals", timeout=WAIT,
            )
            assert [m["reason"] for m in refused] == ["publish_data_not_allowed"] * 3 + ["clients_publish_no_media"]
            # the viewer's socket stays open and it still receives the stream
            frames = len(viewer.frames())
            await viewer.wait_for(lambda p: len(p.frames()) > frames, "more frames", timeout=WAIT)
            await wait_all_tasks_blocked()
            assert pipeline_controls(service) == []  # nothing reached the pipeline
            assert not [m for m in ctl.texts() if m["type"] == "data" and m.get("from") == "watcher"]
            assert (await served.get(created["session_id"]))["status"] == "running"


async def test_a_controller_sending_binary_is_refused_and_keeps_control() -> None:
    async with running_room() as (served, service, created, ctl):
        await ctl.ws.send(b"V" + b"\x00" * 64)
        await ctl.ws.send(b"A\x80\xbb\x00\x00\x01\x00")
        refused = await ctl.wait_for(
            lambda p: (lambda r: r if len(r) >= 2 else None)([m for m in p.texts() if m["type"] == "refused"]),
            "two refusals", timeout=WAIT,
        )
        assert [m["reason"] for m in refused] == ["clients_publish_no_media"] * 2
        assert all("text frames" in m["detail"] and "binary" in m["detail"] for m in refused), refused
        assert pipeline_controls(service) == []
        await ctl.control({"type": "control_state", "controls": ["a"]})
        await wait_for_a_control(service)
        (session,) = service.sessions.values()
        assert session.held == {"a"}


async def test_an_oversized_message_is_refused_and_answered() -> None:
    async with running_room() as (served, service, created, ctl):
        limit = served.runtime.settings.max_data_message_bytes
        await ctl.control({"type": "prompt", "prompt": "x" * (limit + 512)})
        refused = await ctl.wait_for(
            lambda p: [m for m in p.texts() if m["type"] == "refused"], "a refusal", timeout=WAIT
        )
        assert [m["reason"] for m in refused] == ["too_large"]
        assert f"at most {limit} bytes" in refused[0]["detail"] and "--max-data-message-bytes" in refused[0]["detail"]
        await wait_all_tasks_blocked()
        assert pipeline_controls(service) == []


@pytest.mark.parametrize("who", ["controller", "viewer"])
async def test_a_second_connection_with_the_same_identity_is_refused(who: str) -> None:
    async with running_room() as (served, service, created, ctl):
        room = created["room"]
        if who == "controller":
            token, first = created["token"], ctl
            async with join(served, room, token) as second:
                await assert_refused_and_closed(second, {"identity_in_use"})
        else:
            token = await served.viewer_token(created["session_id"], "watcher")
            async with join(served, room, token) as first:
                await first.wait_for(lambda p: any(m["type"] == "joined" for m in p.texts()), "joined", timeout=WAIT)
                async with join(served, room, token) as second:
                    await assert_refused_and_closed(second, {"identity_in_use"})
                await wait_all_tasks_blocked()
                assert "watcher" in served.runtime.transport.participants(room)
        await wait_all_tasks_blocked()
        # the first connection is still in the room and still works
        assert {"ctl", "chunkline-worker-0"} <= served.runtime.transport.participants(room)
        await ctl.control({"type": "control_state", "controls": ["w"]})
        await wait_for_a_control(service)
        assert [c.keys for c in pipeline_controls(service)] == [frozenset({"w"})]
        assert (await served.get(created["session_id"]))["status"] == "running"


async def test_a_viewer_token_reused_in_another_room_is_refused() -> None:
    async with running_room() as (served, service, created, ctl):
        other = await served.create("other-ctl")
        token = await served.viewer_token(created["session_id"], "watcher")
        async with join(served, other["room"], token) as peer:
            await assert_refused_and_closed(peer, {"wrong_room"})
        assert "watcher" not in served.runtime.transport.participants(other["room"])


