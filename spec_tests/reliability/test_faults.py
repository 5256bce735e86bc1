"""Faults, one test each: every one ends in the right terminal state with the right reason, gives the
slot back, admits the next queued session, and leaves no thread, child process or open file behind.

The app runs in-process on the local transport, with WebSocket peers from the runner tests
(``spec_tests/server/runner_fixtures``); pipelines are the engine-backed ``fault_pipelines`` service,
the in-test ``CounterService`` or the toy world. SIGTERM is sent to a real ``chunkline stream-serve``
subprocess with a controller connected over a raw WebSocket.

Terminal states, as the product defines them (server/runner.py ``RoomRunner.run`` / ``_finish``):

- a stage raising, a worker rank dying, LiveKit unreachable, the controller never joining: FAILED,
  with the reason on the record (``error``) and on ``tf.status`` (``type: error``);
- a stage's session-cleanup hook raising: FAILED as well. The runner's drain calls
  ``service.close_session``; the engine leaves the pipeline session POISONED and raises
  ``SessionCleanupError``, which ``_finish`` records as "closing the pipeline session failed: ...".
  The slot is still released. Retrying the cleanup through the orchestrator then succeeds;
- the controller leaving for good: FAILED after ``controller_timeout``, drain cause ``controller_left``, the error naming it.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from states.stream_session import DrainCause
from trio.testing import wait_all_tasks_blocked

from states.pipeline_session import State as PipelineState

from ..server.runner_fixtures import (
    CounterService,
    Served,
    join,
    no_threads,  # noqa: F401  (fixture)
    serve,
    settings,
)
from .fault_pipelines import EngineService, HookExploded, process_denoise_actor
from .helpers import Leaks, RawWebSocket, stream_serve_command, stream_serve_env, wait_until
from ..processes import end_process
from ..virtual_time import elapse

ROOT = Path(__file__).resolve().parents[2]


def record_of(s: Served, session_id: str) -> Any:
    return s.runtime.get(session_id)


def assert_released_and_promoted(s: Served, failed_id: str, queued_id: str) -> None:
    """The failed session holds nothing; the queue head took its slot (and is waiting for its controller)."""
    book = s.runtime.book
    assert not book.holds(failed_id)
    assert failed_id not in s.runtime.runners
    assert book.holds(queued_id) and book.worker_of(queued_id) == "worker-0", s.runtime.health()
    assert record_of(s, queued_id).status.value in ("assigned", "joining_room")
    snapshot = book.snapshot()
    assert (snapshot.retained, snapshot.queued) == (1, 0)


async def delete_and_settle(s: Served, session_id: str) -> None:
    status, body = await s.json("delete", f"/v1/stream/sessions/{session_id}")
    assert status == 200 and body["status"] == "closed", (status, body)
    assert s.runtime.book.snapshot().retained == 0 and not s.runtime.runners


# -- (a) a stage handler raises mid-stream ------------------------------------------------------


@pytest.mark.in_process_only(reason=(
    "the fault is injected into an in-process service object (EngineService) whose orchestrator and "
    "handles the test reads; agent faults (kill -9, SIGSTOP, a cut connection, drain) are "
    "spec_tests/cluster/test_agents.py"
))
async def test_stage_handler_raising_mid_stream_fails_the_session() -> None:
    leaks = Leaks()
    service = EngineService(threaded=True, raise_on_chunk=3)
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        queued = await s.create("ctl-next")
        assert queued["status"] == "queued"
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            errors = await ctl.wait_for(lambda p: p.status("error"), "the session_failed message", timeout=20)
            chunks = ctl.status("chunk")
        record = record_of(s, session_id)
        assert record.status.value == "failed"
        assert "StageExploded" in record.error and "denoise exploded on chunk 3" in record.error, record.error
        assert errors[0]["reason"] == "pipeline_failed" and "denoise exploded on chunk 3" in errors[0]["detail"]
        assert record.drain_cause is DrainCause.PIPELINE_FAILED  # it was None: the record did not say why
        assert [c["index"] for c in chunks] == [0, 1, 2]  # mid-stream: the chunks before the fault went out
        handle = service.handles[record.pipeline_session_id]
        assert handle.status is PipelineState.FAILED  # settled after the background cleanup
        assert service.orch.session_ids == ()  # forgotten: nothing poisoned, nothing held
        assert_released_and_promoted(s, session_id, queued["session_id"])
        await delete_and_settle(s, queued["session_id"])
    await leaks.check()


@pytest.mark.in_process_only(reason=(
    "the fault is a monkeypatch of ToyWorldService in this process; an agent process loads its own; agent"
    " faults (kill -9, SIGSTOP, a cut connection, drain) are spec_tests/cluster/test_agents.py"
))
async def test_toy_world_stage_raising_mid_stream_fails_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same fault in the shipped toy world (its denoise stage raises on chunk 3)."""
    from pipelines.toy_world import ToyWorldConfig, ToyWorldService

    original = ToyWorldService._denoise

    def exploding(self: ToyWorldService, invocation: Any) -> Any:
        if invocation.key.sequence_id == 3 and invocation.key.session_id != "toy-1":  # toy-1: the warm-up
            raise RuntimeError("toy denoise exploded on chunk 3")
        return original(self, invocation)

    monkeypatch.setattr(ToyWorldService, "_denoise", exploding)

    def load(path: str, **_: Any) -> ToyWorldService:
        return ToyWorldService(ToyWorldConfig(height=32, width=48, frames_per_chunk=2), max_sessions=1)

    leaks = Leaks(fd_slack=4)
    async with serve(settings(), load) as s:
        created = await s.create("ctl", config={"continuous": True})
        queued = await s.create("ctl-next")
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            with trio.move_on_after(5):  # the engine fails the pipeline session within milliseconds
                await ctl.wait_for(lambda p: p.status("error"), "the session_failed message", timeout=5)
            record = record_of(s, session_id)
            assert record.status.value == "failed", (
                f"the toy world's stage error did not fail the session: it is {record.status.value} "
                f"5 s after the fault, with chunks {[c['index'] for c in ctl.status('chunk')]}"
            )
        assert "toy denoise exploded on chunk 3" in record.error, record.error
        assert record.drain_cause is DrainCause.PIPELINE_FAILED
        assert_released_and_promoted(s, session_id, queued["session_id"])
        await delete_and_settle(s, queued["session_id"])
    await leaks.check()


# -- (b) a worker process is killed mid-chunk ---------------------------------------------------


@pytest.mark.in_process_only(reason=(
    "it kills a rank of an in-process service's worker group and reads the group; an agent killed "
    "mid-chunk is spec_tests/cluster/test_agents.py::"
    "test_kill_9_mid_chunk_fails_the_session_with_the_cause_and_the_queue_head_runs_elsewhere"
))
async def test_worker_process_killed_mid_chunk_fails_the_session() -> None:
    leaks = Leaks()
    service = EngineService(denoise_actor=lambda: process_denoise_actor(hold_from=2))
    async with serve(settings(), service) as s:
        group = service.actors["denoise"].worker
        pids = group.pids
        assert len(pids) == 1 and multiprocessing.active_children()
        created = await s.create("ctl")
        queued = await s.create("ctl-next")
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: len(p.status("chunk")) >= 2, "two chunks")
            await wait_until(lambda: service.orch.in_flight("denoise") == 1, "chunk 2 in flight in the rank")
            os.kill(pids[0], signal.SIGKILL)
            errors = await ctl.wait_for(lambda p: p.status("error"), "the session_failed message", timeout=20)
        record = record_of(s, session_id)
        assert record.status.value == "failed"
        assert "exited unexpectedly with code -9" in record.error, record.error
        assert "exited unexpectedly with code -9" in errors[0]["detail"]
        assert record.drain_cause is DrainCause.PIPELINE_FAILED == DrainCause(errors[0]["reason"])  # its own stage
        assert group.failed and multiprocessing.active_children() == []
        assert_released_and_promoted(s, session_id, queued["session_id"])
        await delete_and_settle(s, queued["session_id"])
    assert group.closed
    await leaks.check(pids)


# -- (c) a stage's session-cleanup hook raises -----------------------------------------------------


@pytest.mark.in_process_only(reason=(
    "the hook and the retry belong to an in-process service object (EngineService) whose orchestrator the"
    " test reads"
))
async def test_cleanup_hook_raising_poisons_the_pipeline_session_and_a_retry_succeeds() -> None:
    leaks = Leaks()
    service = EngineService(threaded=True, closer_failures=1)
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        queued = await s.create("ctl-next")
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: len(p.status("chunk")) >= 2, "two chunks")
            status, body = await s.json("delete", f"/v1/stream/sessions/{session_id}")
            errors = await ctl.wait_for(lambda p: p.status("error"), "the session_failed message")
        assert status == 200
        record = record_of(s, session_id)
        # the server session still ends, FAILED, with the cleanup failure as its reason
        assert record.status.value == "failed" and body["status"] == "failed", (record.status, body)
        assert record.drain_cause is DrainCause.DELETED
        assert "closing the pipeline session failed" in record.error and "SessionCleanupError" in record.error
        assert "decode could not release session" in record.error, record.error
        assert "closing the pipeline session failed" in errors[0]["detail"]
        # the pipeline session is poisoned, the failure counted, the slot released all the same
        handle = service.handles[record.pipeline_session_id]
        assert handle.status is PipelineState.POISONED
        assert isinstance(handle.cleanup_error, HookExploded)
        assert service.orch.diagnostics().cleanup_failures == 1
        assert service.orch.session_ids == (record.pipeline_session_id,)
        assert_released_and_promoted(s, session_id, queued["session_id"])
        # retrying the cleanup through the orchestrator runs the hook again, and it succeeds
        await handle.aclose()
        assert handle.status is PipelineState.CANCELLED, handle.status
        assert service.orch.session_ids == ()
        assert [reason for sid, reason in service.closer_calls if sid == record.pipeline_session_id] == [
            "cancelled",
            "cancelled",
        ]
        assert ("retry", "started") in handle.shutdown_phases and service.orch.diagnostics().cleanup_failures == 1
        await delete_and_settle(s, queued["session_id"])
    await leaks.check()


@pytest.mark.in_process_only(reason="virtual time (autojump_clock, no threads); an agent process runs in real time")
@pytest.mark.usefixtures("no_threads")
async def test_a_pipeline_close_that_does_not_end_fails_the_session_and_replaces_its_worker(autojump_clock: Any) -> None:
    """A session's pipeline close that outlasts CLOSE_PIPELINE_TIMEOUT leaves what it held in the service in doubt:
    the session fails naming it, and the worker is replaced as after a crash. It stayed in service, its slot free,
    and the next session was admitted onto it."""
    from server.runner import CLOSE_PIPELINE_TIMEOUT

    service = CounterService(close_delay=CLOSE_PIPELINE_TIMEOUT + 60)
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: len(p.frames()) >= 2, "frames streaming")
            await s.json("delete", f"/v1/stream/sessions/{session_id}")
            errors = await ctl.wait_for(lambda p: p.status("error"), "the session's error")
        record = record_of(s, session_id)
        assert record.status.value == "failed" and record.error == "closing the pipeline session timed out", record.error
        assert "closing the pipeline session timed out" in errors[0]["detail"]
        status, health = await s.json("get", "/v1/stream/health")
        assert health["free_slots"] == 0, health  # out of service: nothing is admitted onto it
        await wait_until(lambda: s.runtime.book.snapshot().free_slots == 1, "the replacement worker to be ready",
                         deadline=60)
        status, health = await s.json("get", "/v1/stream/health")
        assert health["worker_restarts"] == 1, health
        replacement = await s.create("ctl-after")
        assert replacement["status"] == "assigned", replacement


@pytest.mark.in_process_only(reason="virtual time (autojump_clock, no threads); an agent process runs in real time")
@pytest.mark.usefixtures("no_threads")
async def test_a_worker_told_to_fail_takes_no_session_while_its_service_takes_long_to_leave(
    autojump_clock: Any
) -> None:
    """The worker a timed-out pipeline close fails leaves its service, which may take a while: meanwhile it takes no
    session, and health and a refused create say why. It stayed `running` with its slots free, nothing logged, and the
    next create streamed from a service that was shutting down, until ``running()`` had returned."""
    from server.runner import CLOSE_PIPELINE_TIMEOUT

    service = CounterService(close_delay=CLOSE_PIPELINE_TIMEOUT + 60, leave_delay=120)
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: len(p.frames()) >= 2, "frames streaming")
            await s.json("delete", f"/v1/stream/sessions/{created['session_id']}")
            await ctl.wait_for(lambda p: p.status("error"), "the session's error")
        status, health = await s.json("get", "/v1/stream/health")
        assert health["free_slots"] == 0 and health["worker_restarts"] == 0, health
        assert [w["state"] for w in health["workers"]] == ["failed"], health
        (slot,) = health["worker_slots"].values()
        assert "took over" in slot["reason"] and "leaving its service" in slot["reason"], slot
        status, refused = await s.json("post", "/v1/stream/sessions", json={"identity": "ctl-next"})
        # not placed on the dying worker, nor queued for it: the create says why
        assert status == 503 and refused["error"] == "no_worker", (status, refused)
        assert "worker-0: failing (closing session" in refused["detail"], refused
        await wait_until(lambda: s.runtime.book.snapshot().free_slots == 1, "the replacement worker to be ready",
                         deadline=200)
        assert (await s.create("ctl-after"))["status"] == "assigned"
        status, health = await s.json("get", "/v1/stream/health")
        assert health["worker_restarts"] == 1, health


# -- (e), (f): the controller (virtual time, no threads) ---------------------------------------------


@pytest.mark.in_process_only(reason="virtual time (autojump_clock, no threads); an agent process runs in real time")
@pytest.mark.usefixtures("no_threads")
async def test_controller_dropping_mid_stream_fails_the_session_after_the_timeout(autojump_clock: Any) -> None:
    leaks = Leaks()
    service = CounterService()
    async with serve(settings(controller_timeout=30), service) as s:
        created = await s.create("ctl")
        queued = await s.create("ctl-next")
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: len(p.frames()) >= 5, "frames streaming")
            # the socket goes away mid-stream (the block ends while frames are flowing), and never returns
        dropped = trio.current_time()
        await elapse(29)
        await wait_all_tasks_blocked()
        assert record_of(s, session_id).status.value == "running"
        await elapse(2)
        await wait_all_tasks_blocked()
        record = record_of(s, session_id)
        assert record.status.value == "failed"
        assert record.error == "the controller 'ctl' left and did not return within 30 s"
        assert record.drain_cause is DrainCause.CONTROLLER_LEFT
        assert 30 <= (record.terminal_since or 0) - dropped < 31
        assert service.closed == [record.pipeline_session_id]
        assert_released_and_promoted(s, session_id, queued["session_id"])
        await delete_and_settle(s, queued["session_id"])
    await leaks.check()


@pytest.mark.in_process_only(reason="virtual time (autojump_clock, no threads); an agent process runs in real time")
@pytest.mark.usefixtures("no_threads")
async def test_controller_never_joining_fails_the_session_naming_the_timeout(autojump_clock: Any) -> None:
    leaks = Leaks()
    service = CounterService()
    async with serve(settings(controller_timeout=45), service) as s:
        start = trio.current_time()
        created = await s.create("ctl")
        queued = await s.create("ctl-next")
        session_id = created["session_id"]
        await elapse(44)
        await wait_all_tasks_blocked()
        assert record_of(s, session_id).status.value == "joining_room"
        await elapse(2)
        await wait_all_tasks_blocked()
        record = record_of(s, session_id)
        assert record.status.value == "failed"
        assert "controller" in record.error and "'ctl'" in record.error and "45 s" in record.error, record.error
        assert 45 <= (record.terminal_since or 0) - start < 46
        assert not service.sessions
        assert_released_and_promoted(s, session_id, queued["session_id"])
        await delete_and_settle(s, queued["session_id"])
    await leaks.check()


# -- (g) SIGTERM with a live session -------------------------------------------------------------------

SERVING = re.compile(rb"chunkline: serving \S+ on (http://127\.0\.0\.1:(\d+))")
START_DEADLINE = 30.0
AGENT_START_DEADLINE = 240.0  # an agent process imports torch (slow on a loaded 2-core host)
EXIT_DEADLINE = 30.0  # wall seconds a phase may take before the test gives up
DRAIN_BOUND = 10.0  # SIGTERM -> exit 0 with one live session (the drain itself takes milliseconds)


@pytest.mark.parametrize("workers", ["in-process", "local"])
async def test_sigterm_drains_live_sessions_and_exits_0(workers: str) -> None:
    """``local``: the worker is a ``chunkline worker`` agent process; the authority drains it the same way."""
    import httpx

    command = stream_serve_command("pipelines/replay", "--port", "0", "--workers", workers)
    leaks = Leaks()
    process = await trio.lowlevel.open_process(command, cwd=str(ROOT), env=stream_serve_env(), stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = bytearray()
    found = trio.Event()

    async def read_log() -> None:
        assert process.stderr is not None
        async for data in process.stderr:
            log.extend(data)
            if SERVING.search(log):
                found.set()
        found.set()

    def text() -> str:
        return log.decode(errors="replace")[-4000:]

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_log)
            with trio.move_on_after(START_DEADLINE):
                await found.wait()
            match = SERVING.search(log)
            assert match, f"the server did not start:\n{text()}"
            base, port = match.group(1).decode(), int(match.group(2))
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                with trio.fail_after(START_DEADLINE if workers == "in-process" else AGENT_START_DEADLINE):
                    while (await client.get("/v1/service/ready")).status_code != 200:
                        await trio.sleep(0.05)  # bench-cost: poll interval while a real server process starts (bounded)
                response = await client.post("/v1/stream/sessions",
                                             json={"identity": "ctl", "config": {"duration_seconds": 3600}})
                assert response.status_code == 200, response.text
                created = response.json()
            ws = await RawWebSocket.connect("127.0.0.1", port, f"{created['websocket_path']}?token={created['token']}")
            inbox: list[Any] = []
            with trio.fail_after(20):
                while not any(isinstance(m, dict) and m.get("topic") == "tf.status"
                              and m["payload"].get("type") == "chunk" for m in inbox):
                    inbox.append(await ws.receive())
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            # the controller hears the drain (``done``) and the worker leaving; then the socket closes
            socket_closed_after: float | None = None
            with trio.move_on_after(DRAIN_BOUND):
                while True:
                    message = await ws.receive()
                    if message is None:
                        socket_closed_after = time.monotonic() - signalled
                        break
                    inbox.append(message)
            await ws.aclose()  # if the server did not close it, the client gives up (hypercorn may then finish)
            with trio.move_on_after(EXIT_DEADLINE):
                rc = await process.wait()
            took = time.monotonic() - signalled
            assert process.returncode is not None, f"no exit within {EXIT_DEADLINE:g} s of SIGTERM:\n{text()}"
            assert rc == 0, f"exit status {rc}:\n{text()}"
            texts = [m for m in inbox if isinstance(m, dict)]
            done = [m["payload"] for m in texts if m.get("topic") == "tf.status" and m["payload"].get("type") == "done"]
            assert done, (
                f"the live session was not drained while its controller was connected: no 'done' on tf.status "
                f"within {DRAIN_BOUND:g} s of SIGTERM (the socket closed after {socket_closed_after}, exit after "
                f"{took:.1f} s); last messages {[m.get('payload', m) for m in texts[-3:]]}\n{text()}"
            )
            worker = f"chunkline-{created['worker_id']}"  # chunkline-worker-0, or the agent's fresh id
            assert any(m.get("type") == "participant_left" and m.get("identity") == worker for m in texts)
            assert took < DRAIN_BOUND, f"SIGTERM -> exit took {took:.1f} s:\n{text()}"
            assert re.search(r"drain|shutting down|shutdown", text(), re.IGNORECASE), (
                f"the server logged nothing about draining its live session:\n{text()}")
            nursery.cancel_scope.cancel()
    finally:
        await end_process(process)
    await leaks.check((process.pid,))
