"""The toy world as a BidirectionalService (reference C.5 "Service semantics"), through ``running()``.

The stages run on real threads, so "nothing more happens" is established by
:func:`quiesce` (every session's orchestrator idle and every trio task blocked),
never by sleeping. The trio clock is a frozen MockClock: idle timeouts pass only
when a test jumps it. Motion is measured on the decoded frames: the column-mean
profile of a grey frame, brute-force shift search.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from engine import SlotPoolFullError
from pipelines.contract import Chunk, Control, ControlRejected, ControlType, ServiceEvent, SessionConfig
from pipelines.toy_world import get_service

from .toy_world_views import bottom_rows, column_profile, ground_shift_px

SIZE = dict(height=32, width=48, frames_per_chunk=2)
FPC = SIZE["frames_per_chunk"]
STEP = 0.1  # lateral_step / move_step (defaults)


def keys(*names: str) -> Control:
    return Control(ControlType.CONTROL_STATE, keys=frozenset(names))


def press(key: str, pressed: bool = True) -> Control:
    return Control(ControlType.CONTROL, key=key, pressed=pressed)


class Reader:
    """Collects one session's chunks in a task; ``wait_for(n)`` waits until n arrived."""

    def __init__(self, service: Any, session_id: str) -> None:
        self.service = service
        self.session_id = session_id
        self.chunks: list[Chunk] = []
        self.done = trio.Event()
        self._lot = trio.lowlevel.ParkingLot()

    async def run(self) -> None:
        try:
            async with aclosing(self.service.chunks(self.session_id)) as chunks:
                async for chunk in chunks:
                    self.chunks.append(chunk)
                    self._lot.unpark_all()
        finally:
            self.done.set()
            self._lot.unpark_all()

    async def wait_for(self, count: int) -> list[Chunk]:
        while len(self.chunks) < count:
            if self.done.is_set():
                raise AssertionError(f"the session ended after {len(self.chunks)} chunks, expected {count}")
            await self._lot.park()
        return self.chunks

    @property
    def poses(self) -> list[list[float]]:
        return [list(c.applied_controls["pose"]) for c in self.chunks]


async def quiesce(service: Any) -> None:
    """Until no stage call of any session runs and every trio task is blocked."""
    while True:
        await trio.testing.wait_all_tasks_blocked()
        busy = [s.orch for s in service._sessions.values() if s.orch.in_flight]
        if not busy:
            return  # in_flight counts a call that ended on its thread until trio has run its follow-ups
        for orch in busy:
            await orch.wait_until_idle()


async def progress_or_stall(service: Any, reader: Reader, count: int, why: str) -> None:
    """Wait for ``count`` chunks of ``reader``; fail if the service goes quiescent first
    (a session that holds a key is never quiescent while it makes progress)."""
    async with trio.open_nursery() as race:

        async def progress() -> None:
            await reader.wait_for(count)
            race.cancel_scope.cancel()

        async def stall() -> None:
            await quiesce(service)
            raise AssertionError(f"{why}: stalled at {len(reader.chunks)} chunks; {service._lease.book!r}")

        race.start_soon(progress)
        race.start_soon(stall)


def content_shift_left(before: np.ndarray, after: np.ndarray, max_shift: int = 10) -> int:
    """The s that best explains after[c] == before[c + s] over the bottom rows (the nearest ground;
    s > 0: content moved left)."""
    rows = bottom_rows(before.shape[0])
    a, b = column_profile(before, rows), column_profile(after, rows)
    width = len(a)
    best, best_err = 0, np.inf
    for s in range(-max_shift, max_shift + 1):
        lo, hi = max(0, -s), min(width, width - s)
        err = np.mean((b[lo:hi] - a[lo + s : hi + s]) ** 2)
        if err < best_err:
            best, best_err = s, err
    return best


@pytest.fixture
async def service() -> AsyncIterator[Any]:
    svc = get_service(**SIZE, max_sessions=2)
    async with svc.running():
        yield svc


@pytest.fixture
async def nursery() -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as n:
        yield n
        n.cancel_scope.cancel()


async def open_session(service: Any, nursery: trio.Nursery, config: SessionConfig | None = None, **kw: Any) -> tuple[str, Reader]:
    session_id = await service.create_session(config or SessionConfig(), **kw)
    reader = Reader(service, session_id)
    nursery.start_soon(reader.run)
    return session_id, reader


# -- preview and held keys ------------------------------------------------------------------------------


async def test_creation_makes_one_preview_chunk_then_waits(service, nursery, mock_clock):
    sid, reader = await open_session(service, nursery)
    (chunk,) = await reader.wait_for(1)
    assert chunk.index == 0
    assert chunk.frames.shape == (FPC, 32, 48, 3) and chunk.frames.dtype == np.uint8
    assert chunk.applied_controls["keys"] == []
    assert chunk.applied_controls["pose"] == [0.0, 0.0, 0.0, 0.0]
    assert chunk.fps == service.config.fps
    assert set(chunk.metadata["stage_times"]) == {"encode", "denoise", "decode"}
    await quiesce(service)
    assert len(reader.chunks) == 1  # nothing held: no further chunk
    await service.close_session(sid)


async def test_holding_d_moves_the_camera_right_and_the_content_left(service, nursery, mock_clock):
    sid, reader = await open_session(service, nursery)
    await reader.wait_for(1)
    await service.push_control(sid, keys("d"))
    chunks = await reader.wait_for(7)
    xs = [c.applied_controls["pose"][0] for c in chunks]
    for i in range(1, 7):
        assert chunks[i].index == i
        assert chunks[i].applied_controls["keys"] == ["d"]
        assert xs[i] == pytest.approx(xs[i - 1] + FPC * STEP)
        assert chunks[i].applied_controls["pose"][1:] == [0.0, 0.0, 0.0]
    assert xs[6] == pytest.approx(6 * FPC * STEP)
    # the nearest ground moves left by the parallax of its depth (spec_tests/pipelines/toy_world_views.py)
    cfg = service.config
    expected = ground_shift_px(5 * FPC * STEP, bottom_rows(cfg.height), cfg.height, cfg.eye_height)  # pixels
    shifts = [content_shift_left(chunks[i].frames[-1], chunks[i + 1].frames[-1]) for i in range(1, 6)]
    assert all(s >= 0 for s in shifts), shifts
    total = content_shift_left(chunks[1].frames[-1], chunks[6].frames[-1])
    assert total > 0
    assert abs(total - expected) <= 2, (total, expected)
    await service.close_session(sid)


async def test_releasing_every_key_stops_new_chunks_after_the_in_flight_ones(service, nursery, mock_clock):
    sid, reader = await open_session(service, nursery)
    await reader.wait_for(1)
    await service.push_control(sid, keys("d"))
    await reader.wait_for(4)
    await service.push_control(sid, keys())
    await quiesce(service)
    count = len(reader.chunks)
    session = service._sessions[sid]
    assert count == session.submitted  # the in-flight ones were delivered
    assert count <= 4 + 2  # at most what was already requested (UNDELIVERED_LIMIT)
    await quiesce(service)
    assert len(reader.chunks) == count
    assert session.submitted == count  # nothing new requested
    assert reader.chunks[-1].applied_controls["keys"] in (["d"], [])
    await service.close_session(sid)


async def test_a_short_press_between_chunks_still_makes_one_chunk(service, nursery, mock_clock):
    sid, reader = await open_session(service, nursery)
    await reader.wait_for(1)
    await quiesce(service)
    await service.push_control(sid, press("d"))
    await service.push_control(sid, press("d", pressed=False))
    chunks = await reader.wait_for(2)
    assert chunks[1].applied_controls["keys"] == ["d"]
    assert chunks[1].applied_controls["pose"][0] == pytest.approx(FPC * STEP)
    await quiesce(service)
    assert len(reader.chunks) == 2


async def test_reset_clears_held_keys_but_keeps_the_pose(service, nursery, mock_clock):
    sid, reader = await open_session(service, nursery)
    await reader.wait_for(1)
    await service.push_control(sid, keys("d", "w"))
    await reader.wait_for(3)
    await service.push_control(sid, Control(ControlType.RESET))
    await quiesce(service)
    count = len(reader.chunks)
    pose = reader.poses[-1]
    assert pose[0] > 0 and pose[1] > 0
    assert service._sessions[sid].held == set()
    await quiesce(service)
    assert len(reader.chunks) == count  # no key held: no chunk
    await service.push_control(sid, press("i"))
    await service.push_control(sid, press("i", pressed=False))
    chunks = await reader.wait_for(count + 1)
    after = chunks[count].applied_controls
    assert after["keys"] == ["i"]
    assert after["pose"][:3] == pytest.approx(pose[:3])  # x, z, yaw kept
    assert after["pose"][3] == pytest.approx(pose[3] + FPC * service.config.pitch_step_deg)


async def test_reset_pose_returns_to_the_identity_pose(service, nursery, mock_clock):
    sid, reader = await open_session(service, nursery)
    await reader.wait_for(1)
    await service.push_control(sid, keys("a", "l"))
    await reader.wait_for(3)
    await service.push_control(sid, keys())
    await quiesce(service)
    count = len(reader.chunks)
    assert reader.poses[-1] != [0.0, 0.0, 0.0, 0.0]
    await service.push_control(sid, Control(ControlType.RESET_POSE))
    chunks = await reader.wait_for(count + 1)
    assert chunks[count].applied_controls["pose"] == [0.0, 0.0, 0.0, 0.0]
    assert chunks[count].applied_controls["reset_pose"] is True
    # the pose restarts from identity
    await service.push_control(sid, press("d"))
    await service.push_control(sid, press("d", pressed=False))
    chunks = await reader.wait_for(count + 2)
    assert chunks[count + 1].applied_controls["pose"] == pytest.approx([FPC * STEP, 0.0, 0.0, 0.0])
    assert chunks[count + 1].applied_controls["reset_pose"] is False


async def test_a_prompt_changes_the_frames(service, nursery, mock_clock):
    frames = {}
    for label, control in (("plain", Control(ControlType.RESET_POSE)), ("prompt", Control(ControlType.PROMPT, prompt="a red sunset"))):
        sid, reader = await open_session(service, nursery)
        await reader.wait_for(1)
        await quiesce(service)
        await service.push_control(sid, control)  # each asks for exactly one more chunk, in place
        chunks = await reader.wait_for(2)
        assert chunks[1].applied_controls["pose"] == [0.0, 0.0, 0.0, 0.0]
        frames[label] = (chunks[0].frames, chunks[1].frames)
        await service.close_session(sid)
    assert np.array_equal(frames["plain"][0], frames["prompt"][0])  # same preview
    assert not np.array_equal(frames["plain"][1], frames["prompt"][1])
    diff = np.abs(frames["plain"][1].astype(int) - frames["prompt"][1].astype(int)).mean()
    assert diff > 2


async def test_stop_ends_the_chunk_stream(service, nursery, mock_clock):
    sid, reader = await open_session(service, nursery)
    await reader.wait_for(1)
    await service.push_control(sid, keys("w"))
    await reader.wait_for(2)
    await service.push_control(sid, Control(ControlType.STOP))
    await reader.done.wait()
    count = len(reader.chunks)
    assert [c.index for c in reader.chunks] == list(range(count))
    with pytest.raises(ControlRejected):
        await service.push_control(sid, keys("w"))
    await service.close_session(sid)


# -- determinism ------------------------------------------------------------------------------------------


async def run_offline(seed: int) -> list[Chunk]:
    svc = get_service(**SIZE, seed=seed)
    config = SessionConfig(options={"continuous": True, "chunks": 4}, timeline=[(0.2, keys("d"))])
    async with svc.running():
        sid = await svc.create_session(config)
        chunks = [chunk async for chunk in svc.chunks(sid)]
        await svc.close_session(sid)
    return chunks


async def test_same_seed_and_timeline_give_identical_frames_and_other_seeds_differ():
    first, second, other = await run_offline(0), await run_offline(0), await run_offline(1)
    assert [c.index for c in first] == [0, 1, 2, 3]
    # the scripted control applies to the first chunk starting at or after 0.2 s (chunk 2 at 0.25 s)
    assert [c.applied_controls["keys"] for c in first] == [[], [], ["d"], ["d"]]
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(a.frames, b.frames)
        assert a.applied_controls == b.applied_controls
    assert not np.array_equal(first[0].frames, other[0].frames)


# -- slots, capacity, close ---------------------------------------------------------------------------------


async def test_slots_are_reused_across_many_sessions_without_new_storage(service, mock_clock):
    slots = service._slots
    pointers = (slots.worlds.data_ptr(), slots.caches.data_ptr(), slots.poses.data_ptr())
    for _ in range(20):
        sid = await service.create_session(SessionConfig())
        async with aclosing(service.chunks(sid)) as chunks:
            async for _chunk in chunks:
                break
        assert slots.pool.in_use == 1
        await service.close_session(sid)
        assert (slots.worlds.data_ptr(), slots.caches.data_ptr(), slots.poses.data_ptr()) == pointers
    assert service._slots.pool.in_use == 0
    assert len(service._lease.book) == 0
    assert float(slots.worlds.abs().sum()) == 0.0 and float(slots.caches.abs().sum()) == 0.0


async def test_a_session_beyond_max_sessions_is_refused(service, nursery, mock_clock):
    a, reader_a = await open_session(service, nursery)
    b, reader_b = await open_session(service, nursery)
    with pytest.raises(SlotPoolFullError):
        await service.create_session(SessionConfig())
    assert service._slots.pool.in_use == 2
    assert set(service._sessions) == {a, b}
    await reader_a.wait_for(1)
    mock_clock.jump(service.control_idle_timeout)  # a idles out: b gets the lease for its preview
    await reader_b.wait_for(1)
    await service.close_session(a)
    c, reader_c = await open_session(service, nursery)  # a's slot is free again
    await reader_c.wait_for(1)
    assert service._slots.pool.in_use == 2


async def test_closing_a_session_releases_its_slot_and_lease(service, nursery, mock_clock):
    sid, reader = await open_session(service, nursery)
    await reader.wait_for(1)
    await service.push_control(sid, keys("w"))
    await reader.wait_for(2)
    assert sid in service._lease.book and service._slots.pool.in_use == 1
    await service.close_session(sid)
    await reader.done.wait()
    assert sid not in service._lease.book
    assert service._slots.pool.in_use == 0
    assert sid not in service._sessions
    await service.close_session(sid)  # idempotent


async def test_push_control_on_an_unknown_session_is_rejected(service, mock_clock):
    with pytest.raises(ControlRejected, match="unknown session"):
        await service.push_control("nope", keys("w"))


async def test_closing_a_session_while_its_denoise_runs(service, nursery, mock_clock):
    """close_session during a running denoise: the denoise-completion callback must not
    refill the prefetch window of a session that no longer admits input."""
    sid, reader = await open_session(service, nursery)
    await reader.wait_for(1)
    gate, entered = threading.Event(), threading.Event()
    denoise = service._model.denoise_chunk

    def held_denoise(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        gate.wait(30)
        return denoise(*args, **kwargs)

    service._model.denoise_chunk = held_denoise
    try:
        await service.push_control(sid, keys("d"))
        await trio.to_thread.run_sync(entered.wait)
        async with trio.open_nursery() as closing:
            closing.start_soon(service.close_session, sid)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()  # the denoise ends while the session is being cancelled
    finally:
        gate.set()
        service._model.denoise_chunk = denoise
    assert service._slots.pool.in_use == 0
    assert sid not in service._lease.book


# -- lease events ----------------------------------------------------------------------------------------------


def event_log(events: list[tuple[str, str]]):
    def sink(event: ServiceEvent) -> None:
        events.append((event.session_id, event.type))

    return sink


async def test_by_default_a_busy_holder_keeps_the_lease_until_its_controller_is_silent_for_the_idle_timeout(
    service, nursery, mock_clock
):
    """The seed's rule (no rotation): a holds "d" with no heartbeat and keeps running while b waits; once
    a's controller has been silent for control_idle_timeout, a is parked at a chunk boundary and b runs;
    a, still holding "d", queues again only on its controller's next control."""
    events: list[tuple[str, str]] = []
    a, reader_a = await open_session(service, nursery, on_event=event_log(events))
    await reader_a.wait_for(1)
    await service.push_control(a, keys("d"))  # held, never refreshed
    await reader_a.wait_for(3)
    b, reader_b = await open_session(service, nursery, on_event=event_log(events))
    assert [e for e in events if e[0] == b] == [(b, "lease_queued")]
    await reader_a.wait_for(len(reader_a.chunks) + 3)  # a runs on: no time has passed
    assert reader_b.chunks == [] and (a, "lease_parked") not in events
    mock_clock.jump(service.control_idle_timeout)
    await progress_or_stall(service, reader_b, 1, "b's preview once a idled out")
    assert (a, "lease_parked") in events and (b, "lease_granted") in events
    await quiesce(service)
    parked_at, seen = len(reader_a.chunks), len(events)
    mock_clock.jump(service.control_idle_timeout)  # more silence: a still holds "d" but stays parked
    await quiesce(service)
    assert len(reader_a.chunks) == parked_at and (a, "lease_queued") not in events[seen:]
    await service.push_control(a, keys("d"))  # a new control: a queues, b (idle) steps aside
    await progress_or_stall(service, reader_a, parked_at + 1, "a after its new control")
    await service.push_control(a, keys())


async def test_with_rotation_a_second_session_is_queued_then_takes_turns_with_a_busy_one(mock_clock):
    svc = get_service(**SIZE, max_sessions=2, rotate_lease=True)  # the pipeline opts in
    events: list[tuple[str, str]] = []
    async with svc.running(), trio.open_nursery() as nursery:
        a, reader_a = await open_session(svc, nursery, on_event=event_log(events))
        await reader_a.wait_for(1)
        await svc.push_control(a, keys("d"))
        await reader_a.wait_for(3)
        b, reader_b = await open_session(svc, nursery, on_event=event_log(events))
        assert [e for e in events if e[0] == b] == [(b, "lease_queued")]
        await progress_or_stall(svc, reader_b, 1, "b's preview")  # a yields at a chunk boundary, still holding "d"
        assert [e for e in events if e[0] == b][:2] == [(b, "lease_queued"), (b, "lease_granted")]
        count = len(reader_a.chunks)
        # a keeps going afterwards (b has nothing more to do), without waiting for b's idle timeout
        await progress_or_stall(svc, reader_a, count + 2, "a holds 'd' after b's preview")
        assert (a, "lease_parked") not in events
        await svc.push_control(a, keys())
        nursery.cancel_scope.cancel()


async def test_a_holder_with_nothing_to_run_steps_aside_at_once(mock_clock):
    """A holder that let go of its keys relinquishes the lease (it is parked) as soon as
    someone waits: the waiter does not wait for the holder's idle timeout."""
    svc = get_service(**SIZE, max_sessions=2, control_idle_timeout=30.0)
    events: list[tuple[str, str]] = []
    async with svc.running(), trio.open_nursery() as nursery:
        a, reader_a = await open_session(svc, nursery, on_event=event_log(events))
        await reader_a.wait_for(1)
        await svc.push_control(a, keys("d"))
        await reader_a.wait_for(3)
        await svc.push_control(a, keys())  # a lets go: nothing more to run
        await quiesce(svc)
        count = len(reader_a.chunks)
        b, reader_b = await open_session(svc, nursery, on_event=event_log(events))
        await svc.push_control(b, keys("w"))
        await reader_b.wait_for(2)  # no clock jump: b is served without waiting 30 s
        assert (b, "lease_granted") in events
        assert (a, "lease_parked") in events
        assert len(reader_a.chunks) == count
        await svc.push_control(b, keys())
        nursery.cancel_scope.cancel()


async def test_a_slot_release_that_fails_once_is_retried_and_leaves_the_pool_whole(service, nursery, mock_clock, monkeypatch):
    slots = service._slots
    real_release = type(slots).release
    failures: list[int] = []

    def release_failing_once(self: Any, slot: int) -> None:
        if not failures:
            failures.append(slot)
            raise RuntimeError(f"injected: slot {slot} could not be zeroed")
        real_release(self, slot)

    monkeypatch.setattr(type(slots), "release", release_failing_once)
    sid, reader = await open_session(service, nursery)
    await reader.wait_for(1)
    assert slots.pool.in_use == 1
    await service.close_session(sid)  # the denoise hook fails: the pipeline session is poisoned
    assert failures and slots.pool.in_use == 1  # not released, and not forgotten either
    assert sid in service._sessions
    await service.close_session(sid)  # the retry releases the slot
    assert slots.pool.in_use == 0 and slots.pool.available == slots.pool.capacity
    assert sid not in service._sessions
    for _ in range(slots.pool.capacity):  # every slot can be handed out again
        await open_session(service, nursery)
    assert slots.pool.in_use == slots.pool.capacity
