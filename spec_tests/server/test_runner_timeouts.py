"""The room runner's timeouts on the trio clock (autojump): controller_timeout, room_empty_timeout,
session_timeout. The service is the in-test async CounterService and the JPEG encoder runs inline
(``no_threads``), so virtual time moves only through timers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from pipelines.contract import Chunk, ServerPushService, SessionConfig
from server.runner import CLOSE_PIPELINE_TIMEOUT, CONTROL_TIMEOUT, CREATE_PIPELINE_TIMEOUT
from server.runtime import DELETE_WAIT
from server.transport import ParticipantJoined, TransportError
from server.transport.local import WorkerConnection
from states.stream_session import DrainCause

from .runner_fixtures import (
    WORKER_IDENTITY,
    CounterService,
    Peer,
    Served,
    join,
    no_threads,  # noqa: F401  (fixture)
    serve,
    settings,
)
from ..virtual_time import elapse, elapse_until

pytestmark = pytest.mark.usefixtures("no_threads")


def left_of(peer: Peer, identity: str) -> bool:
    return any(m.get("type") == "participant_left" and m.get("identity") == identity for m in peer.texts())


def status_of(s: Served, session_id: str) -> str:
    return s.runtime.get(session_id).status.value


async def until(t: float) -> None:
    await elapse_until(t)
    await wait_all_tasks_blocked()


async def test_controller_never_joins_fails_the_session_and_frees_the_slot(
    autojump_clock: Any
) -> None:
    service = CounterService()
    async with serve(settings(controller_timeout=5, queue_size=1), service) as s:
        start = trio.current_time()
        created = await s.create("ctl")
        queued = await s.create("ctl-next")
        assert queued["status"] == "queued"
        await until(start + 4.5)
        assert status_of(s, created["session_id"]) == "joining_room"
        await until(start + 6)
        view = await s.get(created["session_id"])
        assert view["status"] == "failed"
        assert "controller" in view["error"] and "'ctl'" in view["error"] and "5 s" in view["error"], view["error"]
        assert not service.sessions  # no pipeline session was created
        assert created["session_id"] not in s.runtime.runners
        # the slot went to the queue head
        assert status_of(s, queued["session_id"]) in ("assigned", "joining_room")
        assert s.runtime.get(queued["session_id"]).worker_id == "worker-0"
        assert s.runtime.book.holds(queued["session_id"]) and not s.runtime.book.holds(created["session_id"])


async def test_controller_leaving_for_good_fails_the_session_naming_the_controller(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    service = CounterService()
    async with serve(settings(controller_timeout=5, max_sessions_per_worker=1), service) as s:
        created = await s.create("ctl")
        session_id = created["session_id"]
        token = await s.viewer_token(session_id, "watcher")
        async with join(s, created["room"], token) as viewer:
            async with join(s, created["room"], created["token"]) as ctl:
                await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            left = trio.current_time()
            await until(left + 4.5)
            assert status_of(s, session_id) == "running"  # a viewer is here: the room is not empty
            (error,) = await viewer.wait_for(lambda p: p.status("error"), "the error", timeout=2)
            assert error["reason"] == "controller_left" and "'ctl'" in error["detail"] and "5 s" in error["detail"]
        view = await s.get(session_id)
        assert view["status"] == "failed" and view["drain_cause"] == "controller_left"
        assert view["error"] == "the controller 'ctl' left and did not return within 5 s"
        # in the log as a worker's failure is (a session failed on a presence timeout was in no line)
        assert (f"session {session_id} failed: the controller 'ctl' left and did not return within 5 s"
                in [r.getMessage() for r in caplog.records if r.levelname == "WARNING"])
        assert s.runtime.get(session_id).drain_cause is DrainCause.CONTROLLER_LEFT
        assert service.closed == list(service.sessions)
        assert s.free_slots() == 1 and not s.runtime.runners


async def test_a_controller_the_room_let_in_just_before_its_deadline_is_not_absent(
    autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The room's door let the controller in (`joined` said) a moment before controller_timeout, and the runner's
    watch had not taken the join in yet when the timer was judged: the session failed `controller_absent`, its
    controller connected (a race hit 7 times in 50 joins within 10 ms of the deadline). Here the join's event reaches
    the watch 2 s late, as a busy watch takes it."""
    taken = WorkerConnection.next_event

    async def late_joins(connection: WorkerConnection) -> Any:
        event = await taken(connection)
        if isinstance(event, ParticipantJoined):
            await trio.sleep(2)  # bench-cost: virtual; the watch's delay
        return event

    monkeypatch.setattr(WorkerConnection, "next_event", late_joins)
    service = CounterService()
    async with serve(settings(controller_timeout=5), service) as s:
        start = trio.current_time()
        created = await s.create("ctl")
        await until(start + 4)
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            view = await s.get(created["session_id"])
            assert view["status"] == "running" and view["drain_cause"] is None, view
            assert trio.current_time() > start + 5


async def test_controller_returning_within_the_timeout_keeps_the_session(autojump_clock: Any) -> None:
    service = CounterService()
    async with serve(settings(controller_timeout=5), service) as s:
        created = await s.create("ctl")
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
        left = trio.current_time()
        await until(left + 3)
        assert status_of(s, session_id) == "running"
        async with join(s, created["room"], created["token"]) as again:
            joined = await again.wait_for(lambda p: [m for m in p.texts() if m["type"] == "joined"], "joined")
            assert WORKER_IDENTITY in joined[0]["participants"]
            await until(left + 20)  # well past the first departure's deadline
            assert status_of(s, session_id) == "running"
            assert s.runtime.get(session_id).drain_cause is None
            assert again.status("chunk") and len(again.frames()) > 0
            assert not left_of(again, WORKER_IDENTITY)
            assert service.closed == []


async def test_empty_room_closes_the_session(autojump_clock: Any) -> None:
    service = CounterService()
    async with serve(settings(controller_timeout=60, room_empty_timeout=5, max_sessions_per_worker=1), service) as s:
        created = await s.create("ctl")
        session_id = created["session_id"]
        token = await s.viewer_token(session_id, "watcher")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            async with join(s, created["room"], token) as viewer:
                await viewer.wait_for(lambda p: p.frames(), "a frame")
            viewer_left = trio.current_time()
            await until(viewer_left + 10)  # the controller is still there: the room is not empty
            assert status_of(s, session_id) == "running"
        emptied = trio.current_time()
        await until(emptied + 4.5)
        assert status_of(s, session_id) == "running"
        await until(emptied + 5.5)
        record = s.runtime.get(session_id)
        assert record.status.value == "closed" and record.drain_cause is DrainCause.ROOM_EMPTY
        assert (await s.get(session_id))["drain_cause"] == "room_empty"
        assert s.free_slots() == 1 and service.closed == list(service.sessions)


async def test_with_the_defaults_a_controller_that_never_joins_fails_at_the_controller_timeout(
    autojump_clock: Any
) -> None:
    """Controller 60 s, room-empty 30 s: a room nobody entered is waiting for its controller, not empty."""
    service = CounterService()
    async with serve(settings(controller_timeout=60, room_empty_timeout=30), service) as s:
        start = trio.current_time()
        created = await s.create("ctl")
        await until(start + 45)
        assert status_of(s, created["session_id"]) == "joining_room"  # past the room-empty timeout
        await until(start + 61)
        view = await s.get(created["session_id"])
        assert view["status"] == "failed" and view["drain_cause"] == "controller_absent"
        assert view["error"] == "the controller 'ctl' did not join within 60 s"
        assert s.free_slots() == 1 and not service.sessions


async def test_session_timeout_expires_a_running_session_and_admits_the_queue(
    autojump_clock: Any
) -> None:
    service = CounterService()
    async with serve(settings(session_timeout=10, max_sessions_per_worker=1, queue_size=1), service) as s:
        start = trio.current_time()
        created = await s.create("ctl")
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            await until(start + 5)
            queued = await s.create("ctl-next")  # its own deadline is start + 15
            assert queued["status"] == "queued"
            await until(start + 9.5)
            assert status_of(s, session_id) == "running"
            (done,) = await ctl.wait_for(lambda p: p.status("done"), "done", timeout=3)
            assert trio.current_time() >= start + 10
            assert done["published_frames"] > 0
            await ctl.wait_for(lambda p: left_of(p, WORKER_IDENTITY), "the worker to leave")
            await wait_all_tasks_blocked()
        record = s.runtime.get(session_id)
        assert record.status.value == "expired", record.status
        assert record.drain_cause is DrainCause.EXPIRED and record.error is None
        assert (await s.get(session_id))["status"] == "expired"
        assert service.closed == list(service.sessions)
        assert not s.runtime.book.holds(session_id)
        assert status_of(s, queued["session_id"]) in ("assigned", "joining_room")
        assert s.runtime.book.holds(queued["session_id"])


class StuckService(CounterService):
    """A CounterService whose create_session or push_control never returns (the model is wedged)."""

    def __init__(self, *, stuck_controls: bool = False) -> None:
        super().__init__()
        self.stuck_controls = stuck_controls

    async def push_control(self, session_id: str, control: Any) -> None:
        if self.stuck_controls:
            await trio.sleep_forever()
        await super().push_control(session_id, control)


async def test_a_pipeline_that_never_creates_the_session_fails_it_at_the_deadline(autojump_clock: Any) -> None:
    """Principle 3: a DELETE while the service hangs in create_session answers within its wait, and the
    session ends failed at the create deadline with the reason instead of staying draining."""
    service = StuckService()
    service.create_gate = trio.Event()  # never set
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "starting_pipeline" in p.stages(), "starting_pipeline")
            start = trio.current_time()
            status, body = await s.json("delete", f"/v1/stream/sessions/{session_id}")
            assert status == 200 and body["status"] == "draining"
            assert trio.current_time() - start <= DELETE_WAIT + 1
            await until(start + CREATE_PIPELINE_TIMEOUT + 1)
            record = await s.get(session_id)
            assert record["status"] == "failed" and f"within {CREATE_PIPELINE_TIMEOUT:g} s" in record["error"], record
            errors = await ctl.wait_for(lambda p: p.status("error"), "the error on tf.status")
            assert "did not create the session" in errors[0]["detail"]
        assert s.free_slots() == 1 and not s.runtime.runners


async def test_a_pipeline_that_never_takes_a_control_fails_the_session_at_the_deadline(autojump_clock: Any) -> None:
    service = StuckService(stuck_controls=True)
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            await ctl.control({"type": "control", "key": "w", "pressed": True})
            sent = trio.current_time()
            await until(sent + CONTROL_TIMEOUT + 1)
            record = await s.get(created["session_id"])
            assert record["status"] == "failed" and "did not take a control" in record["error"], record
            assert record["drain_cause"] == "pipeline_stalled", record
        assert s.free_slots() == 1 and not s.runtime.runners


class HoldingService(CounterService):
    """A CounterService one of whose calls holds trio's thread past its deadline (a ``time.sleep`` in an ``async
    def``): on the mock clock, time moves on while the call never yields."""

    def __init__(self, clock: Any, call: str) -> None:
        super().__init__()
        self.clock = clock
        self.call = call

    def _hold(self, call: str, deadline: float) -> None:
        if call == self.call:
            self.clock.jump(deadline + 5)

    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        self._hold("create_session", CREATE_PIPELINE_TIMEOUT)
        return await super().create_session(config, on_event=on_event)

    async def push_control(self, session_id: str, control: Any) -> None:
        self._hold("push_control", CONTROL_TIMEOUT)
        await super().push_control(session_id, control)

    async def close_session(self, session_id: str) -> None:
        self._hold("close_session", CLOSE_PIPELINE_TIMEOUT)
        await super().close_session(session_id)


@pytest.mark.parametrize(("call", "error", "cause"), [
    ("create_session", f"did not create the session within {CREATE_PIPELINE_TIMEOUT:g} s", "pipeline_failed"),
    ("push_control", "did not take a control", "pipeline_stalled"),
    ("close_session", "closing the pipeline session timed out", "deleted"),
])
async def test_a_pipeline_call_that_holds_trio_past_its_deadline_counts_as_late(
    call: str, error: str, cause: str, autojump_clock: Any
) -> None:
    """A call that returns without ever yielding, past its deadline: the move_on_after had no cancel to catch, and
    it was taken as on time (a push_control 20 s long left its session `running`; a create 65 s long streamed; a
    close 35 s long left its worker in service). Each is late as one cut at the deadline is; a late create's
    pipeline session is closed."""
    service = HoldingService(autojump_clock, call)
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            if call != "create_session":
                await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            if call == "push_control":
                await ctl.control({"type": "control", "key": "w", "pressed": True})
            if call == "close_session":
                await s.json("delete", f"/v1/stream/sessions/{created['session_id']}")
            await until(trio.current_time() + 90)  # (the call's jump moves the clock too)
            record = await s.get(created["session_id"])
            assert record["status"] == "failed" and error in record["error"], record
            assert record["drain_cause"] == cause, record
        assert service.closed == list(service.sessions)  # a late create's session too
        if call == "close_session":  # what the session holds in the service is in doubt: its worker is replaced
            status, health = await s.json("get", "/v1/stream/health")
            assert health["worker_restarts"] == 1, health


@asynccontextmanager
async def released_at_the_end(released: trio.Event) -> AsyncIterator[None]:
    try:
        yield
    finally:
        released.set()


class StreamWithStuckCleanup(ServerPushService):
    """A server-push pipeline whose stream's cleanup never ends (a decoder's close that hangs)."""

    def __init__(self) -> None:
        self.cleanup_started = trio.Event()
        self.released = trio.Event()  # set by the test as it ends, so that a server that waits for ever can stop

    @asynccontextmanager
    async def running(self) -> AsyncIterator[StreamWithStuckCleanup]:
        yield self

    async def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        index = 0
        try:
            while True:  # the runner paces the chunks: the stream waits at its yield
                yield Chunk(index=index, frames=np.zeros((1, 16, 16, 3), np.uint8), fps=4.0)
                index += 1
        finally:
            self.cleanup_started.set()
            await self.released.wait()


async def test_a_server_push_stream_whose_close_hangs_fails_the_session_at_the_close_deadline(
    autojump_clock: Any
) -> None:
    """The stream's close ran shielded with no deadline: a DELETE left the session draining for good, its slot
    held. It is bounded as close_session is: the session fails naming the close, and the worker is replaced."""
    service = StreamWithStuckCleanup()
    async with serve(settings(), service) as s, released_at_the_end(service.released):
        created = await s.create("ctl")
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            start = trio.current_time()
            status, body = await s.json("delete", f"/v1/stream/sessions/{session_id}")
            assert status == 200 and body["status"] == "draining"
            assert service.cleanup_started.is_set()
            await until(start + CLOSE_PIPELINE_TIMEOUT + 1)
            record = await s.get(session_id)
            assert record["status"] == "failed", record
            assert f"stream took over {CLOSE_PIPELINE_TIMEOUT:g} s" in record["error"], record
            (error,) = await ctl.wait_for(lambda p: p.status("error"), "the error on tf.status")
            assert "stream took over" in error["detail"]
        assert not s.runtime.runners and not s.runtime.book.holds(session_id)


async def test_a_session_deleted_just_before_its_timeout_ends_closed_as_deleted(autojump_clock: Any) -> None:
    """The drain's cause is set once: the session timeout passing during a DELETE's drain changes nothing."""
    service = CounterService(close_delay=3.0)  # the drain outlasts the session's deadline
    async with serve(settings(session_timeout=10), service) as s:
        start = trio.current_time()
        created = await s.create("ctl")
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            await until(start + 9.5)
            status, body = await s.json("delete", f"/v1/stream/sessions/{session_id}")
            assert status == 200, (status, body)
            assert trio.current_time() > start + 12  # the sweep ran past the deadline during the drain
            (done,) = await ctl.wait_for(lambda p: p.status("done"), "done")
            assert done["reason"] == "deleted"
        view = await s.get(session_id)
        assert view["status"] == "closed" and view["drain_cause"] == "deleted" and view["error"] is None
        assert s.runtime.get(session_id).drain_cause is DrainCause.DELETED


async def test_a_pipeline_s_own_chunk_metadata_keys_are_not_overwritten(autojump_clock: Any) -> None:
    service = CounterService(metadata={"frames": "the pipeline's own", "fps": 24})
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            (chunk, *_) = await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
        assert chunk["data"]["frames"] == "the pipeline's own" and chunk["data"]["fps"] == 24
        assert chunk["data"]["first_frame"] == 0 and "publish_finished_at" in chunk["data"]


async def test_health_transport_connected_and_its_livekit_alias_follow_the_seed(autojump_clock: Any) -> None:
    """True while a worker is in its room with media: starting_pipeline, running or draining."""
    service = CounterService(close_delay=3.0)
    async with serve(settings(), service) as s:
        async def connected() -> tuple[bool, bool]:
            status, body = await s.json("get", "/v1/stream/health")
            assert status == 200
            return body["transport_connected"], body["livekit_connected"]

        created = await s.create("ctl")
        await wait_all_tasks_blocked()
        assert status_of(s, created["session_id"]) == "joining_room" and await connected() == (False, False)
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            assert await connected() == (True, True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(s.json, "delete", f"/v1/stream/sessions/{created['session_id']}")
                await elapse(1.0)  # inside the 3 s drain
                assert status_of(s, created["session_id"]) == "draining" and await connected() == (True, True)
        await wait_all_tasks_blocked()
        assert await connected() == (False, False)


async def test_health_does_not_count_a_draining_session_whose_worker_never_joined_its_room(
    autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's join hangs (a LiveKit server that does not answer) and the session is deleted: it drains with no
    worker in its room, and health said ``transport_connected`` for it (a draining state was counted as media)."""
    async with serve(settings(), CounterService()) as s:
        async def hangs(room: str, identity: str, token: str, *, timeout: float) -> Any:
            await elapse(timeout)
            raise TransportError(f"room {room!r}: no answer within {timeout:g} s")

        monkeypatch.setattr(s.runtime.transport, "connect", hangs)
        created = await s.create("ctl")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.json, "delete", f"/v1/stream/sessions/{created['session_id']}")
            await elapse(1.0)
            assert status_of(s, created["session_id"]) == "draining"
            status, body = await s.json("get", "/v1/stream/health")
            assert (body["transport_connected"], body["livekit_connected"]) == (False, False), body


async def test_data_on_a_wrong_topic_is_answered_with_a_refusal_like_other_refused_data(autojump_clock: Any) -> None:
    service = CounterService()
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            await ctl.send("app.chat", {"type": "control_state", "controls": ["w"]})
            (refusal,) = await ctl.wait_for(lambda p: p.status("control_rejected"), "the refusal")
            assert refusal["reason"] == "wrong_topic" and "tf.control" in refusal["detail"]
            assert service.sessions[s.runtime.get(created["session_id"]).pipeline_session_id].controls == []


async def test_a_closed_session_s_tokens_no_longer_join_its_room(autojump_clock: Any) -> None:
    service = CounterService()
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        viewer = await s.viewer_token(created["session_id"], "watcher")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
        status, _ = await s.json("delete", f"/v1/stream/sessions/{created['session_id']}")
        assert status == 200 and (await s.get(created["session_id"]))["status"] == "closed"
        for token in (created["token"], viewer):  # both still within their TTL
            async with join(s, created["room"], token) as late:
                await late.reader_done.wait()
            assert [m for m in late.texts() if m.get("type") == "refused"] == [{"type": "refused", "reason": "session_closed",
                                                                                  "detail": "the session has ended: its room is closed"}]
