"""Session options come from remote clients: through a real server they may not name server files outside
``--assets-dir`` (the replay pipeline's ``video_path``), nor make the server hold an unbounded chunk. The
pipeline refuses such options before anything is held: the create is a 400 ``invalid_option`` with its reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from ..pipelines.test_replay import write_video
from .test_hostile_server import WAIT, Server, running, wait_for


async def _refusal(server: Server, config: dict[str, Any]) -> str:
    """Create a session with ``config``: the pipeline refuses it (400 ``invalid_option``); its reason, and no record."""
    status, body = await server.request("POST", "/v1/stream/sessions", {"identity": "ctl", "config": config})
    assert status == 400 and body["error"] == "invalid_option", (config, status, body)
    listed = (await server.request("GET", "/v1/stream/sessions"))[1]["sessions"]
    assert not [s for s in listed if s["status"] not in ("closed", "failed", "expired")], listed
    return body["detail"]


async def _outcome(server: Server, config: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Create a session with ``config``, join as its controller, and read until it failed or sent 3 frames."""
    status, created = await server.request("POST", "/v1/stream/sessions", {"identity": "ctl", "config": config})
    assert status == 200, (status, created)
    room = await server.room(created)
    frames = 0
    try:
        with trio.move_on_after(WAIT):
            while frames < 3 and (message := await room.receive()) is not None:
                if isinstance(message, bytes):
                    frames += 1
                elif message.get("topic") == "tf.status" and message["payload"].get("type") == "error":
                    break
    finally:
        await room.aclose()

    async def record() -> dict[str, Any] | None:
        found = (await server.request("GET", f"/v1/stream/sessions/{created['session_id']}"))[1]
        return found if found["status"] in ("running", "failed") else None

    found = await wait_for(record, "the session to run or fail")
    await server.request("DELETE", f"/v1/stream/sessions/{created['session_id']}")
    return found, frames


async def test_a_client_cannot_replay_a_server_file_without_an_assets_dir(tmp_path: Path) -> None:
    clip = tmp_path / "private.mp4"
    write_video(clip, [200] * 10)
    async with running() as server:
        refused = await _refusal(server, {"video_path": str(clip)})
    assert "video_path' needs the server to be started with --assets-dir" in refused


async def test_a_clients_video_path_must_be_inside_the_assets_dir(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    write_video(assets / "clip.mp4", [200] * 40)
    outside = tmp_path / "private.mp4"
    write_video(outside, [50] * 10)
    (assets / "link.mp4").symlink_to(outside)
    small = {"width": 32, "height": 16, "fps": 10}
    async with running(assets_dir=str(assets)) as server:
        found, frames = await _outcome(server, {**small, "video_path": "clip.mp4"})
        assert found["status"] == "running" and frames == 3, found
        for name, why in [(str(outside), "must be relative to the assets directory"),
                          ("../private.mp4", "may not contain '..'"),
                          ("link.mp4", "resolves outside the assets directory"),
                          ("nope.mp4", "does not exist in the assets directory")]:
            refused = await _refusal(server, {**small, "video_path": name})
            assert f"video_path' {why}" in refused, (name, refused)


async def test_a_chunk_a_client_asks_for_is_bounded_before_it_is_made() -> None:
    async with running() as server:
        # 4096 x 4096 x 3 x 1024 frames: 51 GB a chunk had the request been taken
        refused = await _refusal(server, {"width": 4096, "height": 4096, "frames_per_chunk": 1024})
    assert "at most 67108864" in refused, refused


async def test_an_option_the_toy_world_does_not_know_is_refused_naming_it() -> None:
    async with running(pipeline="pipelines/toy_world") as server:
        for config, named in [({"seeed": 3}, "unknown option(s) ['seeed']"),
                              ({"continuous": "no"}, "option 'continuous' must be true or false")]:
            refused = await _refusal(server, config)
            assert named in refused, (config, refused)
