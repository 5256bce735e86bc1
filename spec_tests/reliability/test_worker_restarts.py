"""Failing workers: their sessions fail with the cause, queued sessions wait for the replacement and are
never promoted onto the dying worker, a failed worker is replaced with backoff (new id, its own plan), a
crash loop stops the restarts and health says why, metrics count restarts, and a frozen service child is
declared failed by its heartbeat deadline (principles 3, 4 and 6 of the hostile-clients issue).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from server.process_service import start_process_service
from states.restart_policy import RestartPolicy

from ..server import runner_fixtures as fixtures
from ..server.runner_fixtures import CounterService, join, settings, wait_until

FAST = RestartPolicy(base_delay=0.05, max_delay=0.2, factor=2.0, max_failures=2, window=60.0)


class DyingService(CounterService):
    """A CounterService whose ``running()`` fails as a whole (the model crashed) when ``die`` is set."""

    def __init__(self) -> None:
        super().__init__(fps=20, frames_per_chunk=2, size=(8, 8))
        self.die = trio.Event()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[DyingService]:
        async with trio.open_nursery() as nursery:

            async def crash() -> None:
                await self.die.wait()
                raise RuntimeError("the model crashed (test)")

            nursery.start_soon(crash)
            yield self
            nursery.cancel_scope.cancel()


class Loader:
    """Hands out the given services in turn; ``None`` stands for a load that fails, each in its own words (a
    transient failure: two loads that fail alike before any loaded end the slot's restarts)."""

    def __init__(self, *services: DyingService | None) -> None:
        self.services = list(services)
        self.loaded: list[DyingService] = []
        self.calls = 0

    def __call__(self, path: str, **_: Any) -> DyingService:
        self.calls += 1
        service = self.services.pop(0) if self.services else None
        if service is None:
            raise RuntimeError(f"the model file is corrupt (test, load {self.calls})")
        self.loaded.append(service)
        return service


def serve(loader: Any, **overrides: Any) -> Any:
    """The app with the fast restart policy; the tests wait for readiness themselves."""
    return fixtures.serve(settings(**overrides), loader, restart_policy=FAST, ready=False)


async def test_a_dying_worker_fails_its_sessions_and_the_queue_waits_for_its_replacement() -> None:
    first, second = DyingService(), DyingService()
    async with serve(Loader(first, second)) as s:
        await wait_until(lambda: s.runtime.ready, "the first worker")
        running = await s.create("ctl")
        queued = await s.create("ctl-next")
        assert running["worker_id"] == "worker-0" and queued["status"] == "queued"
        async with join(s, running["room"], running["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "the session to run", timeout=20)
            first.die.set()
            errors = await ctl.wait_for(lambda p: p.status("error"), "the session's error", timeout=20)
        record = await s.get(running["session_id"])
        assert record["status"] == "failed", record
        assert "worker worker-0 failed" in record["error"] and "the model crashed (test)" in record["error"]
        assert "the model crashed (test)" in errors[0]["detail"]
        # the queued session went to the replacement, never to the dead worker
        await wait_until(lambda: s.runtime.book.worker_of(queued["session_id"]) is not None, "the promotion")
        assert s.runtime.book.worker_of(queued["session_id"]) == "worker-0.1"
        assert (await s.get(queued["session_id"]))["worker_id"] == "worker-0.1"
        health = (await s.json("get", "/v1/stream/health"))[1]
        assert health["worker_restarts"] == 1 and health["worker_slots"]["worker-0"]["worker_id"] == "worker-0.1"
        assert "chunkline_worker_restarts_total 1.0" in await s.metrics_text()


async def test_failed_loads_back_off_then_a_fresh_worker_takes_sessions() -> None:
    async with serve(Loader(None, None, DyingService())) as s:
        await wait_until(lambda: s.runtime.ready, "the third load to succeed")
        health = (await s.json("get", "/v1/stream/health"))[1]
        # the replacement serves: health is healthy again and counts the one slot's one worker; the worker it
        # replaced is history, shown under its slot (it counted as a second worker, failed), the one before forgotten
        assert health["status"] == "healthy" and health["worker_restarts"] == 2
        assert (health["workers_total"], health["workers_idle"], health["workers_failed"]) == (1, 1, 0), health
        assert [w["worker_id"] for w in health["workers"]] == ["worker-0.2"], health["workers"]
        replaced = {"worker_id": "worker-0.1", "failure": "RuntimeError: the model file is corrupt (test, load 2)"}
        assert health["worker_slots"]["worker-0"] == {"worker_id": "worker-0.2", "restarts": 2, "state": "running",
                                                       "reason": None, "replaced": replaced}
        created = await s.create("ctl")
        assert created["worker_id"] == "worker-0.2"  # a new id, with its own capacity plan
        metadata = (await s.json("get", "/v1/service/metadata"))[1]
        assert set(metadata["session_capacity"]) == {"worker-0.2"}
        assert "the model file is corrupt" in metadata["worker_failures"]["worker-0.1"]
        assert "worker-0" not in metadata["worker_failures"]


async def test_a_crash_loop_stops_restarting_says_why_and_fails_the_queue() -> None:
    async with serve(Loader(DyingService(), None, None), queue_size=2) as s:
        await wait_until(lambda: s.runtime.ready, "the first worker")
        held = await s.create("ctl")
        queued = await s.create("ctl-next")
        assert queued["status"] == "queued"
        s.runtime.workers["worker-0"].service.die.set()  # type: ignore[union-attr]
        # worker-0 dies, worker-0.1 and worker-0.2 fail to load: more than max_failures=2 within the window
        await wait_until(lambda: s.runtime.slots.status(trio.current_time())["worker-0"]["state"] == "gave_up",
                         "the crash loop")
        health = (await s.json("get", "/v1/stream/health"))[1]
        assert health["status"] == "unhealthy" and health["worker_restarts"] == 2
        assert "crash loop" in health["worker_slots"]["worker-0"]["reason"]
        for session_id in (held["session_id"], queued["session_id"]):
            await wait_until(lambda: s.runtime.get(session_id).is_terminal, "the session to end")
            record = await s.get(session_id)
            assert record["status"] == "failed" and record["error"], record
        failed_queued = await s.get(queued["session_id"])
        assert "crash loop" in failed_queued["error"] and failed_queued["drain_cause"] == "worker_failed"
        status, body = await s.json("post", "/v1/stream/sessions", json={"identity": "late"})
        assert status == 503 and body["error"] == "no_worker" and "crash loop" in body["detail"]


@asynccontextmanager
async def a_session_whose_child_is_frozen(loader: Any, pipeline: str) -> AsyncIterator[tuple[Any, dict[str, Any], Any]]:
    """A process worker's session running with its controller in the room, then its service child stopped with
    SIGSTOP (continued at the end if it still lives): yields the server, the created session and the controller."""
    async with serve(loader, pipeline=pipeline, worker_mode="process") as s:
        await wait_until(lambda: s.runtime.ready, "the service child", deadline=120)
        created = await s.create("ctl")
        service = s.runtime.workers["worker-0"].service
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "the session to run", timeout=60)
            os.kill(service.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            try:
                yield s, created, ctl
            finally:
                if service.exitcode is None:  # type: ignore[union-attr]
                    os.kill(service.pid, signal.SIGCONT)  # type: ignore[union-attr]


async def test_a_frozen_service_child_is_declared_failed_and_replaced() -> None:
    """A service child stopped with SIGSTOP answers nothing: its heartbeat deadline kills it, a DELETE of
    its session finishes instead of hanging in draining, health says why, and a fresh child takes over."""
    loader = functools.partial(start_process_service, heartbeat_timeout=2.0)
    async with a_session_whose_child_is_frozen(loader, "pipelines/replay") as (s, created, _ctl):
        with trio.fail_after(30):
            status, body = await s.json("delete", f"/v1/stream/sessions/{created['session_id']}")
        assert status == 200
        await wait_until(lambda: s.runtime.get(created["session_id"]).is_terminal, "the session to end", 30)
        assert (await s.get(created["session_id"]))["status"] in ("closed", "failed")
        await wait_until(lambda: s.runtime.workers["worker-0"].failure, "the frozen child to be declared failed", 30)
        health = (await s.json("get", "/v1/stream/health"))[1]
        assert health["status"] != "healthy", health  # the frozen worker is no longer counted as serving
        metadata = (await s.json("get", "/v1/service/metadata"))[1]
        assert "heartbeat deadline" in metadata["worker_failures"]["worker-0"]
        await wait_until(lambda: "worker-0.1" in s.runtime.workers and s.runtime.ready, "the replacement", 120)
        assert (await s.create("ctl2"))["worker_id"] == "worker-0.1"


def toy_world_in_process(path: str, **options: Any) -> Any:
    """The toy world at test sizes; its stages run in rank processes, the service in the server's process."""
    from pipelines.loader import load_service

    return load_service(path, height=32, width=48, frames_per_chunk=2, control_idle_timeout=60.0, **options)


RANK_PLACEMENT = json.dumps({
    "mode": "process",
    "encode": {"devices": ["cpu"], "world_size": 1, "dtype": "float32"},
    "denoise": {"devices": ["cpu"], "world_size": 1},
    "decode": {"devices": ["cpu"]},
})


async def test_an_in_process_service_whose_stage_dies_is_rebuilt_and_the_queue_moves_to_the_new_one() -> None:
    """In-process worker, toy world stages in rank processes: SIGKILL of the denoise rank fails the stage
    as a whole, so the service leaves running(); the running session fails with the stage's cause, the
    queued one is never promoted onto the dying worker and runs on its replacement (a new id), and health
    and metrics count the restart."""
    async with serve(toy_world_in_process, pipeline="pipelines/toy_world", placement=RANK_PLACEMENT) as s:
        await wait_until(lambda: s.runtime.ready, "the toy world", deadline=120)
        running = await s.create("ctl", config={"continuous": True})
        queued = await s.create("ctl-next")
        assert running["worker_id"] == "worker-0" and queued["status"] == "queued"
        service = s.runtime.workers["worker-0"].service
        async with join(s, running["room"], running["token"]) as ctl, trio.open_nursery() as steering:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk", timeout=60)

            async def keep_steering() -> None:  # controls keep coming as the stage dies
                with contextlib.suppress(Exception):  # until the server closes the socket
                    while True:
                        await ctl.control({"type": "control_state", "controls": ["w"]})
                        await trio.sleep(0.05)  # bench-cost: a controller's pace, on the real clock (a real rank)

            steering.start_soon(keep_steering)
            os.kill(service._stages.groups["denoise"].pids[0], signal.SIGKILL)  # type: ignore[union-attr]
            errors = await ctl.wait_for(lambda p: p.status("error"), "the session's error", timeout=60)
            steering.cancel_scope.cancel()
        # the service lost the session with its stage: controls were refused as "unknown session 'toy-1'" first
        assert not ctl.status("control_rejected"), ctl.status("control_rejected")
        record = await s.get(running["session_id"])
        assert record["status"] == "failed" and "stage 'denoise' failed" in record["error"], record
        assert "stage 'denoise' failed" in errors[0]["detail"]
        await wait_until(lambda: s.runtime.book.worker_of(queued["session_id"]) is not None, "the promotion", 120)
        assert (await s.get(queued["session_id"]))["worker_id"] == "worker-0.1"
        health = (await s.json("get", "/v1/stream/health"))[1]
        assert health["worker_restarts"] == 1 and health["worker_slots"]["worker-0"]["worker_id"] == "worker-0.1"
        assert "stage 'denoise' failed" in (await s.json("get", "/v1/service/metadata"))[1]["worker_failures"]["worker-0"]
        assert "chunkline_worker_restarts_total 1.0" in await s.metrics_text()


async def test_a_killed_service_child_fails_its_session_and_the_queue_skips_the_dying_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Process worker: SIGKILL of the service child. Its session fails with the child's cause; the queued
    session waits for the replacement child rather than being promoted onto the dead one (whose other
    session ends first), and never ends closed without an error. The log says why each session failed in words, never
    as a bare group (``failed: ExceptionGroup: Exceptions from Trio nursery (2 sub-exceptions)``), once, and without
    a traceback."""
    loader = functools.partial(start_process_service, height=32, width=48, frames_per_chunk=2, control_idle_timeout=60.0)
    async with serve(loader, pipeline="pipelines/toy_world", worker_mode="process",
                     max_sessions_per_worker=2, queue_size=1) as s:
        await wait_until(lambda: s.runtime.ready, "the service child", deadline=120)
        first = await s.create("ctl")
        idle = await s.create("ctl-idle")  # assigned, never joined: it ends as the worker dies
        queued = await s.create("ctl-next")
        assert queued["status"] == "queued"
        service = s.runtime.workers["worker-0"].service
        async with join(s, first["room"], first["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "the session to run", timeout=60)
            os.kill(service.pid, signal.SIGKILL)  # type: ignore[union-attr]
            await ctl.wait_for(lambda p: p.status("error"), "the session's error", timeout=60)
        for session_id in (first["session_id"], idle["session_id"]):
            await wait_until(lambda: s.runtime.get(session_id).is_terminal, "the session to end", 30)
            record = await s.get(session_id)
            assert record["status"] == "failed" and "worker worker-0 failed" in record["error"], record
        await wait_until(lambda: s.runtime.book.worker_of(queued["session_id"]) is not None, "the promotion", 120)
        assert (await s.get(queued["session_id"]))["worker_id"] == "worker-0.1"
    failed_lines = [message for message in caplog.messages if f"session {first['session_id']} failed" in message]
    assert failed_lines and not [line for line in failed_lines if "ExceptionGroup" in line], failed_lines
    # one line a session, each without a traceback: the child's death is told by its proxy's line, and the session's
    # failure by the worker's cause (it was 80 lines: two tracebacks through the proxy and trio's internals, the session
    # said failed twice, and a traceback for closing its pipeline session in the dead child)
    assert len(failed_lines) == 1 and "worker worker-0 failed" in failed_lines[0], failed_lines
    assert not [r.getMessage() for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    assert not [m for m in caplog.messages if "closing the pipeline session failed" in m], caplog.messages


async def test_a_frozen_service_child_fails_a_session_sending_controls_as_the_workers_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With the default heartbeat deadline (10 s): a session whose controller kept sending controls failed as
    ``pipeline_stalled`` ("the pipeline did not take a control within 10 s": the control deadline was as long
    as the heartbeat's and fired first), while the same frozen child's other sessions failed ``worker_failed``."""
    async with a_session_whose_child_is_frozen(start_process_service, "spec_tests/cluster/tiny_world.py") as (s, created, ctl):
        with trio.fail_after(60):
            while not s.runtime.get(created["session_id"]).is_terminal:
                await ctl.control({"type": "control_state", "controls": ["w"]})
                await trio.sleep(0.2)  # bench-cost: a controller's pace, on the real clock (a real child)
        record = await s.get(created["session_id"])
        assert record["status"] == "failed" and record["drain_cause"] == "worker_failed", record
        assert "heartbeat deadline" in record["error"] and "was killed" in record["error"], record
    failed_lines = [message for message in caplog.messages if f"session {created['session_id']} failed" in message]
    assert failed_lines and not [line for line in failed_lines if "ExceptionGroup" in line], failed_lines


class SlowToClose(DyingService):
    """A DyingService whose ``close_session`` waits for the test (the session stays the worker's meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.closing = trio.Event()
        self.close_gate = trio.Event()

    async def close_session(self, session_id: str) -> None:
        self.closing.set()
        await self.close_gate.wait()
        await super().close_session(session_id)


async def test_a_replaced_worker_that_still_held_a_session_is_forgotten_once_the_session_ends() -> None:
    """A slot keeps its current worker and the one it replaced; an older one is forgotten. One that still held a
    session's place then (its runner still closing the pipeline session) stayed in the server's book for ever:
    shown in metadata's worker_failures, kept in memory, whatever came after. It goes once that session ends."""
    first = SlowToClose()
    async with serve(Loader(first, None, DyingService())) as s:
        await wait_until(lambda: s.runtime.ready, "the first worker")
        running = await s.create("ctl")
        async with join(s, running["room"], running["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "the session to run", timeout=20)
            first.die.set()
            with trio.fail_after(20):
                await first.closing.wait()
        # worker-0.1 failed to load, worker-0.2 loaded: worker-0 is two workers back, but still holds the session
        await wait_until(lambda: s.runtime.ready, "the third load to succeed")
        health = (await s.json("get", "/v1/stream/health"))[1]
        assert health["worker_slots"]["worker-0"]["worker_id"] == "worker-0.2", health["worker_slots"]
        metadata = (await s.json("get", "/v1/service/metadata"))[1]
        assert "worker-0" in metadata["worker_failures"], metadata["worker_failures"]
        first.close_gate.set()
        await wait_until(lambda: s.runtime.get(running["session_id"]).is_terminal, "the session to end")
        assert (await s.get(running["session_id"]))["status"] == "failed"
        metadata = (await s.json("get", "/v1/service/metadata"))[1]
        assert set(metadata["worker_failures"]) == {"worker-0.1"}, metadata["worker_failures"]
        assert metadata["workers_total"] == 1 and metadata["retained_sessions"] == 0, metadata
