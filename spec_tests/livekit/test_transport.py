"""``LiveKitTransport`` against the real server: what only a real server shows at the worker's side.

Each scenario of :mod:`spec_tests.livekit.transport_probe` runs in its own process inside the namespace
(the transport, as the stream server runs it) and reports what it saw; the assertions are here.
"""

from __future__ import annotations

import json
import signal
import sys

import pytest
import trio

from .conftest import ROOT, LiveKit

pytestmark = pytest.mark.livekit


#: how the LiveKit SDK's native core dies when one of its own tasks panics (seen once in many runs, on a loaded
#: host, in the refused-publish scenario): the process aborts, which is the SDK's fault, not the transport's
SDK_PANIC = b"panic in a function that cannot unwind"


async def probe(livekit: LiveKit, scenario: str) -> dict:
    """The scenario's report. A run the SDK's native core aborted is run once more (and fails the test if it
    aborts again): the assertions are about the transport, which the SDK's own crash says nothing about."""
    config = livekit.config
    argv = [*livekit.network.prefix(), sys.executable, "-m", "spec_tests.livekit.transport_probe", scenario,
            config.url, config.api_key, config.api_secret]
    for attempt in range(2):
        with trio.fail_after(60):
            done = await trio.run_process(argv, cwd=ROOT, capture_stdout=True, capture_stderr=True, check=False)
        if not (done.returncode == -signal.SIGABRT and SDK_PANIC in done.stderr and attempt == 0):
            break
        print(f"the LiveKit SDK aborted the {scenario!r} probe; running it once more:\n"
              f"{done.stderr.decode(errors='replace')[-1500:]}", file=sys.stderr)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


async def test_a_timed_out_connect_leaves_no_ghost_worker(livekit_server: LiveKit) -> None:
    seen = await probe(livekit_server, "ghost")
    assert seen["error"].endswith("within 0.5 s: no answer (timed out)"), seen
    assert seen["gave_up_after"] < 2.0, seen  # 0.5 s and the hand-over of the join; a loaded machine is slow
    # the SDK went on and joined through its next attempt after the caller had given up...
    assert seen["relay_held_first_connection"] and seen["sdk_retried_after_timeout"], seen
    # ...and the transport took that late join back out of the room
    assert not seen["listed_at_end"], seen


async def test_a_refused_publish_is_reported_on_every_frame(livekit_server: LiveKit) -> None:
    seen = await probe(livekit_server, "publish_refused")
    first, second = seen["errors"]
    assert first is not None and "publishing the video track" in first, seen
    assert second == first, seen  # not silently sent to a source nobody receives


async def test_a_long_chunk_of_audio_does_not_stall_the_next_video_and_leaving_is_prompt(livekit_server: LiveKit) -> None:
    seen = await probe(livekit_server, "media")
    # 2 s of audio is queued, not played out first (the SDK's default 1 s queue would block about 1 s)
    assert seen["audio_seconds"] < 0.5, seen
    assert seen["next_frame_seconds"] < 0.2, seen
    # leaving first, then closing the sources: one round trip, and the worker is gone from the room (the room
    # service is watched until it drops the worker, within LEAVE_SEEN_WITHIN of leaving: see the probe)
    assert seen["listed_before"] and not seen["listed_after"], seen
    assert seen["disconnect_seconds"] < 2.0, seen


async def test_a_sessions_room_is_made_by_the_server_and_its_token_opens_nothing_once_it_is_deleted(
    livekit_server: LiveKit,
) -> None:
    seen = await probe(livekit_server, "rooms")
    # the LiveKit server makes no room on a join (room.auto_create: false): a token opens only a room made for it
    assert seen["join_before_open"] is not None and "does not exist" in seen["join_before_open"], seen
    assert seen["listed_while_open"], seen
    # the session ended, its room deleted: its tokens (valid for token_ttl) do not make it again
    assert seen["join_after_close"] is not None and "does not exist" in seen["join_after_close"], seen
    assert not seen["room_made_again"], seen
    # a refusal names the room and LiveKit's reason
    refused = seen["open_with_a_wrong_secret"]
    assert refused is not None and "could not create the LiveKit room 'probe-impostor-room'" in refused, seen
    assert "LiveKit refused (HTTP 401" in refused and "the API key or secret is wrong" in refused, seen
