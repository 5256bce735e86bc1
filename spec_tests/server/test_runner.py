"""The room runner over the real local transport, in-process (server.runner, server.transport.local).

Two services drive it:

- the toy world (real threads, real time, no autojump) for the end-to-end lifecycle and for
  "the picture follows the controls", measured on the decoded JPEG frames;
- :class:`~spec_tests.server.runner_fixtures.CounterService` (async, no threads) under
  ``autojump_clock`` with the JPEG encoder run inline (``no_threads``) for everything else, so
  virtual time is exact: pacing gaps, stalls, drains, the queue.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import pytest
import trio

from states.stream_session import DrainCause
from trio.testing import wait_all_tasks_blocked

from pipelines.contract import Control, ControlType
from server.tokens import TokenRejected
from server.transport import TransportError
from pipelines.replay import ReplayService
from pipelines.toy_world import ToyWorldConfig, ToyWorldService
from spec_tests.pipelines.toy_world_views import bottom_rows, ground_shift_px

from .runner_fixtures import (
    TOY_WARMUP_WARNING,
    WORKER_IDENTITY,
    CounterService,
    Peer,
    decode_jpeg,
    frame_level,
    join,
    level_of,
    make_issuer,
    no_threads,  # noqa: F401  (fixture)
    serve,
    settings,
    wait_until,
)
from ..virtual_time import elapse

TOY = ToyWorldConfig(height=32, width=48, frames_per_chunk=2)


def toy_loader(path: str, **_: Any) -> ToyWorldService:
    return ToyWorldService(TOY, max_sessions=2)


def toy_settings(**overrides: Any) -> Any:
    return settings(pipeline="pipelines/toy_world", max_sessions_per_worker=2, queue_size=0, **overrides)


def left_of(peer: Peer, identity: str) -> bool:
    return any(m.get("type") == "participant_left" and m.get("identity") == identity for m in peer.texts())


async def worker_gone(peer: Peer) -> None:
    """Wait until the worker left the room (everything it published was pushed before), then deliver."""
    await peer.wait_for(lambda p: left_of(p, WORKER_IDENTITY), "the worker to leave the room")
    await wait_all_tasks_blocked()


def chunk_indices(peer: Peer) -> list[int]:
    return [m["index"] for m in peer.status("chunk")]


# -- picture measurements (as in spec_tests/pipelines/test_toy_world_motion.py) -----------------


def column_profile(frame: np.ndarray) -> np.ndarray:
    return frame.astype(np.float64).mean(axis=-1).mean(axis=0)


def best_shift(reference: np.ndarray, moved: np.ndarray, max_shift: int = 20) -> float:
    """``s`` such that ``moved[i] ~= reference[i + s]``: positive means the content moved toward index 0."""
    n = len(reference)
    errors = []
    for s in range(-max_shift, max_shift + 1):
        lo, hi = max(0, -s), min(n, n - s)
        errors.append(np.mean((moved[lo:hi] - reference[lo + s : hi + s]) ** 2))
    k = int(np.argmin(errors))
    if 0 < k < len(errors) - 1:
        a, b, c = errors[k - 1 : k + 2]
        denom = a - 2 * b + c
        return k - max_shift + (0.5 * (a - c) / denom if denom > 0 else 0.0)
    return float(k - max_shift)


# -- end to end with the toy world (real time) ------------------------------------------------------


@pytest.mark.filterwarnings(TOY_WARMUP_WARNING)
async def test_lifecycle_frames_and_status_over_the_local_transport() -> None:
    async with serve(toy_settings(), toy_loader) as s:
        created = await s.create("ctl")
        assert created["status"] == "assigned" and created["worker_id"] == "worker-0"
        assert created["websocket_path"] == f"/v1/rooms/{created['room']}/ws"
        session_id = created["session_id"]
        await wait_until(lambda: s.runtime.get(session_id).status.value == "joining_room", "joining_room")
        view = await s.get(session_id)
        assert view["status"] == "joining_room" and view["participant_count"] == 0

        async with join(s, created["room"], created["token"]) as ctl:
            joined = await ctl.wait_for(lambda p: [m for m in p.texts() if m["type"] == "joined"], "joined")
            assert joined[0]["role"] == "controller" and WORKER_IDENTITY in joined[0]["participants"]
            await ctl.wait_for(lambda p: "running" in p.stages(), "status running")
            assert ctl.stages()[:2] == ["starting_pipeline", "running"]
            assert ctl.status("status")[1]["data"]["worker_id"] == "worker-0"
            assert all(m["from"] == WORKER_IDENTITY for m in ctl.texts() if m["type"] == "data")
            view = await s.get(session_id)
            assert view["status"] == "running"
            assert view["participant_count"] == 1
            assert view["pipeline_session_id"]

            # the preview chunk: its frames as JPEG binary messages, then its chunk message
            await ctl.wait_for(lambda p: p.status("chunk") and len(p.frames()) >= TOY.frames_per_chunk, "chunk 0")
            chunk = ctl.status("chunk")[0]
            assert chunk["index"] == 0 and chunk["session_id"] == session_id
            assert chunk["data"]["frames"] == TOY.frames_per_chunk and chunk["data"]["fps"] == TOY.fps
            stages = [p["type"] for p in ctl.status()]
            assert stages.index("chunk") > stages.index("status")  # running was said before the first chunk
            for received in ctl.frames()[: TOY.frames_per_chunk]:
                assert received.message[1:3] == b"\xff\xd8"  # a JPEG
                picture = decode_jpeg(received.message[1:])
                assert picture.shape == (TOY.height, TOY.width, 3)

            token = await s.viewer_token(session_id, "viewer-1")
            async with join(s, created["room"], token) as viewer:
                joined = await viewer.wait_for(lambda p: [m for m in p.texts() if m["type"] == "joined"], "joined")
                assert joined[0]["role"] == "viewer"
                assert {"ctl", WORKER_IDENTITY} <= set(joined[0]["participants"])
                await wait_until(lambda: s.runtime.get(session_id).participant_count == 2, "two participants")
                assert (await s.get(session_id))["participant_count"] == 2

                await ctl.control({"type": "control_state", "controls": ["d"]})
                await viewer.wait_for(lambda p: len(p.status("chunk")) >= 2 and len(p.frames()) >= 4, "viewer chunks")
                await ctl.control({"type": "stop"})
                await viewer.wait_for(lambda p: p.status("done"), "done for the viewer")
                await ctl.wait_for(lambda p: p.status("done"), "done for the controller")
                await worker_gone(viewer)
                await worker_gone(ctl)
                # the viewer saw the tail of what the controller saw: same chunk messages, same frames
                seen = chunk_indices(viewer)
                assert seen and chunk_indices(ctl)[-len(seen) :] == seen
                viewer_frames = [r.message for r in viewer.frames()]
                assert [r.message for r in ctl.frames()][-len(viewer_frames) :] == viewer_frames
            await wait_until(lambda: s.runtime.get(session_id).is_terminal, "the session to close")
        assert (await s.get(session_id))["status"] == "closed"
        assert s.free_slots() == 2


@pytest.mark.filterwarnings(TOY_WARMUP_WARNING)
async def test_holding_d_moves_the_view_content_left() -> None:
    chunks_held = 8
    async with serve(toy_settings(), toy_loader) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk") and len(p.frames()) >= TOY.frames_per_chunk, "preview")
            await ctl.control({"type": "control_state", "controls": ["d"]})
            await ctl.wait_for(lambda p: max(chunk_indices(p)) >= chunks_held, "chunks with d held", timeout=20)
            await ctl.control({"type": "control_state", "controls": []})
            await wait_all_tasks_blocked()
            chunks = {m["index"]: m for m in ctl.status("chunk")}
            for index in range(1, chunks_held + 1):
                assert chunks[index]["data"]["applied_controls"]["keys"] == ["d"], chunks[index]
            poses = [chunks[i]["data"]["applied_controls"]["pose"][0] for i in range(1, chunks_held + 1)]
            assert all(b > a for a, b in itertools.pairwise(poses)), poses  # x grows while d is held

            frames = [decode_jpeg(r.message[1:]) for r in ctl.frames()]
            assert len(frames) >= (chunks_held + 1) * TOY.frames_per_chunk
            # the nearest ground (the bottom rows) moves left by the parallax of its depth
            rows = bottom_rows(TOY.height)
            reference = column_profile(frames[TOY.frames_per_chunk - 1][rows])  # the preview's last frame
            half = column_profile(frames[(chunks_held // 2 + 1) * TOY.frames_per_chunk - 1][rows])
            last = column_profile(frames[(chunks_held + 1) * TOY.frames_per_chunk - 1][rows])
            expected = ground_shift_px(TOY.lateral_step, rows, TOY.height, TOY.eye_height)  # px per frame
            moved_half, moved = best_shift(reference, half), best_shift(reference, last)
            frames_moved = chunks_held * TOY.frames_per_chunk
            assert moved > 0.4 * expected * frames_moved, (moved_half, moved, expected * frames_moved)
            assert moved < 1.6 * expected * frames_moved, (moved_half, moved, expected * frames_moved)
            assert 0 < moved_half < moved, (moved_half, moved)


# -- the counter service (autojump, inline encoding) ---------------------------------------------------


@pytest.mark.usefixtures("no_threads")
async def test_viewer_receives_the_same_frames_and_status(autojump_clock: Any) -> None:
    service = CounterService(fps=10, frames_per_chunk=4)
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        token = await s.viewer_token(created["session_id"], "watcher")
        async with join(s, created["room"], token) as viewer:
            await viewer.wait_for(lambda p: [m for m in p.texts() if m["type"] == "joined"], "joined")
            await wait_all_tasks_blocked()
            assert (await s.get(created["session_id"]))["status"] == "joining_room"  # a viewer is not the controller
            async with join(s, created["room"], created["token"]) as ctl:
                await ctl.wait_for(lambda p: len(p.frames()) >= 10, "frames")
                await ctl.control({"type": "stop"})
                await ctl.wait_for(lambda p: p.status("done"), "done")
                await worker_gone(ctl)
                await worker_gone(viewer)
                assert viewer.stages() == ctl.stages() == ["starting_pipeline", "running"]
                assert chunk_indices(viewer) == chunk_indices(ctl) == list(range(len(chunk_indices(ctl))))
                assert viewer.status("done") == ctl.status("done")
                assert [r.message for r in viewer.frames()] == [r.message for r in ctl.frames()]
                levels = [level_of(r.message[1:]) for r in viewer.frames()]
                assert levels == pytest.approx([frame_level(n) for n in range(len(levels))], abs=3)


@pytest.mark.usefixtures("no_threads")
async def test_viewer_control_is_refused_by_the_transport(autojump_clock: Any) -> None:
    service = CounterService()
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        token = await s.viewer_token(created["session_id"], "watcher")
        async with join(s, created["room"], created["token"]) as ctl, join(s, created["room"], token) as viewer:
            await ctl.wait_for(lambda p: "running" in p.stages(), "running")
            await viewer.control({"type": "control_state", "controls": ["d"]})
            await viewer.control({"type": "stop"})
            refused = await viewer.wait_for(
                lambda p: [m for m in p.texts() if m["type"] == "refused"] if len(
                    [m for m in p.texts() if m["type"] == "refused"]) >= 2 else None,
                "two refusals",
            )
            assert [m["reason"] for m in refused] == ["publish_data_not_allowed"] * 2
            assert all("does not allow sending data" in m["detail"] for m in refused), refused
            await elapse(1.0)
            (session,) = service.sessions.values()
            assert session.controls == [] and not session.stopping
            assert not [m for m in ctl.texts() if m["type"] == "data" and m["from"] == "watcher"]
            assert not ctl.status("control_rejected")
            assert (await s.get(created["session_id"]))["status"] == "running"
            assert "chunkline_control_rejections_total{" not in await s.metrics_text()


@pytest.mark.usefixtures("no_threads")
async def test_invalid_control_is_answered_and_counted(autojump_clock: Any) -> None:
    service = CounterService()
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "running")
            await ctl.control({"type": "control_state", "controls": ["x"]})
            (rejected,) = await ctl.wait_for(lambda p: p.status("control_rejected"), "control_rejected")
            assert rejected["reason"] == "unknown_control"
            # the controller is told which names there are (it was told only that 'x' is none of them)
            assert rejected["detail"] == ("unknown control 'x'; known keys: a d i j k l s w (or Key and the letter, "
                                          "as KeyW); also ArrowDown ArrowLeft ArrowRight ArrowUp backward down "
                                          "forward left right up"), rejected
            assert rejected["session_id"] == created["session_id"]
            (session,) = service.sessions.values()
            assert session.controls == []
            text = await s.metrics_text()
            assert 'chunkline_control_rejections_total{reason="unknown_control"} 1.0' in text
            # a valid one still goes through
            await ctl.control({"type": "control_state", "controls": ["d"]})
            await wait_all_tasks_blocked()
            assert session.controls == [Control(ControlType.CONTROL_STATE, keys={"d"})]


async def test_a_control_to_a_server_push_pipeline_is_refused_and_stop_still_ends_it() -> None:
    """A server-push pipeline streams on its own: a valid control was counted and dropped without an answer."""
    async with serve(settings(max_sessions_per_worker=1), ReplayService()) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "running")
            for control in ({"type": "control_state", "controls": ["w"]}, {"type": "prompt", "prompt": "a street"}):
                await ctl.control(control)
            rejected = await ctl.wait_for(lambda p: len(p.status("control_rejected")) == 2 and p.status("control_rejected"),
                                          "both refusals")
            assert [r["reason"] for r in rejected] == ["no_controls", "no_controls"], rejected
            assert "takes no controls but stop" in rejected[0]["detail"]
            text = await s.metrics_text()
            assert 'chunkline_control_rejections_total{reason="no_controls"} 2.0' in text
            await ctl.control({"type": "stop"})
            (done,) = await ctl.wait_for(lambda p: p.status("done"), "done")
            assert done["reason"] == "stop"
        assert s.runtime.get(created["session_id"]).drain_cause is DrainCause.STOP


@pytest.mark.usefixtures("no_threads")
async def test_controls_before_the_pipeline_session_are_applied_when_it_starts(
    autojump_clock: Any
) -> None:
    service = CounterService()
    service.create_gate = trio.Event()
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "starting_pipeline" in p.stages(), "starting_pipeline")
            await service.creating.wait()
            await ctl.control({"type": "control_state", "controls": ["d"]})
            await ctl.control({"type": "control", "key": "w", "event": "press"})
            await wait_all_tasks_blocked()
            assert (await s.get(created["session_id"]))["status"] == "starting_pipeline"
            assert not service.sessions
            assert not ctl.status("control_rejected")
            service.create_gate.set()
            await ctl.wait_for(lambda p: p.status("chunk"), "the first chunk")
            (session,) = service.sessions.values()
            assert session.controls == [
                Control(ControlType.CONTROL_STATE, keys={"d"}),
                Control(ControlType.CONTROL, key="w", pressed=True),
            ]
            assert ctl.status("chunk")[0]["data"]["applied_controls"]["keys"] == ["d", "w"]


@pytest.mark.usefixtures("no_threads")
async def test_stop_ends_the_stream_and_the_queued_session_is_admitted(autojump_clock: Any) -> None:
    service = CounterService(fps=10, frames_per_chunk=4)
    async with serve(settings(max_sessions_per_worker=1, queue_size=1), service) as s:
        first = await s.create("ctl")
        assert first["status"] == "assigned"
        second = await s.create("ctl2")
        assert second["status"] == "queued" and second["queue_position"] == 1
        async with join(s, first["room"], first["token"]) as ctl:
            await ctl.wait_for(lambda p: len(p.status("chunk")) >= 3, "three chunks")
            await ctl.control({"type": "stop"})
            (done,) = await ctl.wait_for(lambda p: p.status("done"), "done")
            await worker_gone(ctl)
            assert done["session_id"] == first["session_id"]
            assert done["total_chunks"] == len(ctl.status("chunk")) >= 3
            assert done["published_frames"] == len(ctl.frames())
            assert done["published_frames"] >= done["total_chunks"] * 4
            record = s.runtime.get(first["session_id"])
            assert record.status.value == "closed" and record.drain_cause is DrainCause.STOP
            assert (await s.get(first["session_id"]))["status"] == "closed"
            (pipeline_id,) = [sid for sid in service.sessions]
            assert service.closed == [pipeline_id]
        view = await s.get(second["session_id"])
        assert view["status"] in ("assigned", "joining_room") and view["worker_id"] == "worker-0"
        assert view["queue_position"] is None
        async with join(s, second["room"], second["token"]) as ctl2:
            await ctl2.wait_for(lambda p: p.status("chunk"), "the second session's first chunk")
            assert (await s.get(second["session_id"]))["status"] == "running"


@pytest.mark.usefixtures("no_threads")
async def test_delete_drains_a_running_session_and_frees_the_slot(autojump_clock: Any) -> None:
    service = CounterService()
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            assert s.free_slots() == 0
            status, body = await s.json("delete", f"/v1/stream/sessions/{created['session_id']}")
            assert status == 200 and body == {"session_id": created["session_id"], "status": "closed"}
            await ctl.wait_for(lambda p: p.status("done"), "done")
            await worker_gone(ctl)
            assert s.runtime.get(created["session_id"]).drain_cause is DrainCause.DELETED
            assert service.closed == list(service.sessions)
            assert s.free_slots() == 1
            assert not s.runtime.runners


@pytest.mark.usefixtures("no_threads")
@pytest.mark.parametrize("kind", ["expired", "forged", "other_room"])
async def test_bad_tokens_are_refused_by_the_websocket(kind: str, autojump_clock: Any) -> None:
    async with serve(settings(max_sessions_per_worker=2), CounterService()) as s:
        created = await s.create("ctl")
        other = await s.create("ctl-b")
        room = created["room"]
        token, reason = {
            "expired": (make_issuer(clock=lambda: time.time() - 7200).controller_token(room, "ctl"), "expired"),
            "forged": (make_issuer(secret="f" * 48).controller_token(room, "ctl"), "bad_signature"),
            "other_room": (other["token"], "wrong_room"),
        }[kind]
        async with join(s, room, token) as peer:
            await peer.reader_done.wait()
            assert peer.texts() == [{"type": "refused", "reason": reason, "detail": TokenRejected(reason).detail}]
            assert peer.closed_with is not None
            assert getattr(peer.closed_with, "code", None) in (4401, None)
        await wait_all_tasks_blocked()
        record = s.runtime.get(created["session_id"])
        assert record.participants == set() and record.status.value == "joining_room"


# -- pacing ----------------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_threads")
async def test_frames_are_paced_at_the_chunk_fps(autojump_clock: Any) -> None:
    service = CounterService(fps=10, frames_per_chunk=4)
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: len(p.frames()) >= 12, "three chunks of frames")
            times = [r.at for r in ctl.frames()[:12]]
            gaps = np.diff(times)
            assert gaps == pytest.approx([0.1] * 11, abs=0.005), gaps
            # a chunk's frames take frames/fps on the clock: the chunk message follows its last frame
            chunk_at = [r.at for r in ctl.inbox if isinstance(r.message, dict)
                        and r.message.get("topic") == "tf.status" and r.message["payload"]["type"] == "chunk"]
            assert chunk_at[0] == pytest.approx(times[3], abs=0.005)


@pytest.mark.usefixtures("no_threads")
async def test_no_catch_up_burst_after_a_stall(autojump_clock: Any) -> None:
    stall = 1.5
    service = CounterService(fps=10, frames_per_chunk=4, stalls={2: stall})
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: len(p.frames()) >= 16, "four chunks of frames")
            gaps = np.diff([r.at for r in ctl.frames()[:16]])
            assert gaps[:7] == pytest.approx([0.1] * 7, abs=0.005), gaps
            assert gaps[7] >= stall - 0.1, gaps  # the stall itself (chunk 2 came late)
            # no burst: after the stall the frames are spaced one interval apart again, never closer
            assert all(g >= 0.1 - 0.005 for g in gaps[8:]), gaps
            assert gaps[8:] == pytest.approx([0.1] * 7, abs=0.005), gaps


# -- closing the pipeline's chunk stream -----------------------------------------------------------------


@pytest.mark.usefixtures("no_threads")
async def test_the_runner_closes_the_chunk_iterator_before_closing_the_session(
    autojump_clock: Any
) -> None:
    """``service.chunks()`` is an async iterator the runner abandons mid-stream on stop; it must close it
    (``aclose``), or an async-generator service is finalized later by the GC (ResourceWarning)."""
    service = CounterService(fps=10, frames_per_chunk=4)
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: len(p.frames()) >= 6, "frames mid-chunk")
            await ctl.control({"type": "stop"})
            await ctl.wait_for(lambda p: p.status("done"), "done")
        (session,) = service.sessions.values()
        assert session.closed
        assert session.iterator_closed_before_close_session, "the runner never closed service.chunks()"


class FailingCreate(CounterService):
    async def create_session(self, config: Any, *, on_event: Any = None) -> str:
        raise ValueError("option 'size' must be an int")


@pytest.mark.usefixtures("no_threads")
async def test_a_pipeline_session_error_fails_the_session_with_its_reason(
    autojump_clock: Any
) -> None:
    service = FailingCreate()
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            (error,) = await ctl.wait_for(lambda p: p.status("error"), "an error message")
            await ctl.wait_for(lambda p: left_of(p, WORKER_IDENTITY), "the worker to leave")
        view = await s.get(created["session_id"])
        assert view["status"] == "failed"
        assert s.free_slots() == 1 and not s.runtime.runners
        assert error["reason"] == view["drain_cause"] == "pipeline_failed"  # the cause was null
        assert "option 'size' must be an int" in error["detail"], error["detail"]
        assert "option 'size' must be an int" in view["error"], view["error"]


async def test_a_session_whose_worker_cannot_join_its_room_fails_saying_so(
    autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The room transport refuses the worker (a LiveKit server that is down, say): the session fails with the
    transport's reason, and its record says why it ended (its drain cause read null)."""
    service = CounterService()
    async with serve(settings(), service) as s:
        async def refused(room: str, identity: str, token: str, *, timeout: float) -> Any:
            raise TransportError(f"room {room!r} refused {identity!r}: the transport is down")

        monkeypatch.setattr(s.runtime.transport, "connect", refused)
        created = await s.create("ctl")
        await wait_all_tasks_blocked()
        view = await s.get(created["session_id"])
        assert (view["status"], view["drain_cause"]) == ("failed", "transport_failed"), view
        assert "the transport is down" in view["error"] and s.free_slots() == 1 and service.sessions == {}
