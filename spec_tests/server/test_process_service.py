"""``worker-mode process``: a pipeline service in a child process behind a proxy (server.process_service).

Each test spawns real children (spawn context): the toy world (torch, in the
child only) and the replay pipeline. Loading is blocking, so it runs in a thread.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pipelines.contract import (
    BidirectionalService,
    Control,
    ControlRejected,
    ControlType,
    ServerPushService,
    ServiceEvent,
    SessionConfig,
)
from server.model_worker import ModelWorker
from server.runner import CLOSE_PIPELINE_TIMEOUT, CONTROL_TIMEOUT, CREATE_PIPELINE_TIMEOUT
from server.process_service import (
    CREDIT_WINDOW,
    CallDeadlines,
    ProcessBidirectionalService,
    ProcessServerPushService,
    ProcessServiceCallTimeout,
    ProcessServiceFailed,
    ProcessServiceStartError,
    RemoteServiceError,
    start_process_service,
)

REPO = Path(__file__).resolve().parents[2]
TOY = "pipelines/toy_world"
TINY = {"height": 32, "width": 48, "frames_per_chunk": 2}


async def start(pipeline: str, **options: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: start_process_service(pipeline, **options))


async def start_written(tmp_path: Path, name: str, source: str, **options: Any) -> Any:
    """Write the pipeline file ``name``.py with ``source`` and start it in a child."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return await start(str(path), **options)


def assert_no_children() -> None:
    assert multiprocessing.active_children() == []


async def test_toy_world_runs_in_a_child_process() -> None:
    service = await start(TOY, **TINY)
    assert isinstance(service, ProcessBidirectionalService) and isinstance(service, BidirectionalService)
    assert service.kind == "bidirectional" and service.supports_timeline is True
    assert service.pid is not None and service.pid != os.getpid()
    service.configure_session_capacity(2)
    events: list[ServiceEvent] = []
    async with service.running():
        report = service.memory_report()
        assert report is not None and report.snapshots[0].process_id == service.pid  # measured in the child
        sid = await service.create_session(SessionConfig(prompt="a field"), on_event=events.append)
        await service.push_control(sid, Control(ControlType.CONTROL_STATE, keys={"w"}))
        applied = []
        with trio.fail_after(20):
            async for chunk in service.chunks(sid):
                assert chunk.frames.shape == (2, 32, 48, 3)
                applied.append(list(chunk.applied_controls["keys"]))
                if chunk.applied_controls["keys"] == ["w"] and chunk.index >= 2:
                    break
        assert ["w"] in applied
        # ControlRejected keeps its reason across the process boundary
        with pytest.raises(ControlRejected) as rejected:
            await service.push_control("toy-999", Control(ControlType.RESET))
        assert "unknown session" in rejected.value.reason
        # other errors carry the child's traceback text
        with pytest.raises(RemoteServiceError) as remote:
            await service.create_session(SessionConfig(options={"chunks": 0}))
        assert remote.value.remote_type == "builtins.ValueError"
        assert "Traceback" in remote.value.remote_traceback and "chunks" in str(remote.value)
        await service.push_control(sid, Control(ControlType.CONTROL_STATE, keys=set()))
        await service.close_session(sid)  # closing mid-denoise is safe (the toy world never raises from its callbacks)
        # the slow consumer: the child runs at most CREDIT_WINDOW chunks ahead of what was taken
        sid2 = await service.create_session(SessionConfig(options={"continuous": True, "chunks": 8}))
        stream = service.chunks(sid2)
        with trio.fail_after(20):
            first = await stream.__anext__()
            await trio.sleep(0.5)  # bench-cost: gives the child time to overrun its credit if it would
            assert len(stream._buffer) <= CREDIT_WINDOW  # type: ignore[attr-defined]
            indices = [first.index] + [chunk.index async for chunk in stream]
        assert indices == list(range(8))
        await service.close_session(sid2)
    assert {"lease_granted"} <= {e.type for e in events} and all(e.session_id == sid for e in events)
    assert service.exitcode == 0
    assert_no_children()


async def test_the_parent_process_never_imports_torch() -> None:
    script = f"""
import json, sys, trio
from server.process_service import start_process_service
from pipelines.contract import SessionConfig

async def main(service):
    async with service.running():
        sid = await service.create_session(SessionConfig())
        chunks = service.chunks(sid)
        chunk = await chunks.__anext__()
        await chunks.aclose()
        await service.close_session(sid)
    return list(chunk.frames.shape)

if __name__ == "__main__":
    service = start_process_service({TOY!r}, **{TINY!r})
    shape = trio.run(main, service)
    print(json.dumps({{"torch": "torch" in sys.modules, "shape": shape, "code": service.exitcode}}))
"""
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-c", script], cwd=str(REPO), capture_stdout=True, capture_stderr=True, check=False
        )
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert result == {"torch": False, "shape": [2, 32, 48, 3], "code": 0}


async def _until_lost(service: Any, hurt: Callable[[], None], within: float) -> tuple[Any, list[BaseException], str]:
    """One session of ``service`` until its first chunk, then ``hurt()``; returns the failure ``running()`` raised
    (within ``within`` seconds), the failures its chunk reader got, and the session's id."""
    failures: list[BaseException] = []
    first_chunk = trio.Event()

    async def consume(sid: str) -> None:
        try:
            async for _ in service.chunks(sid):  # no key held: after the preview chunk it waits
                first_chunk.set()
        except ProcessServiceFailed as exc:
            failures.append(exc)

    with pytest.raises(ProcessServiceFailed) as raised:
        async with service.running():
            sid = await service.create_session(SessionConfig())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume, sid)
                with trio.fail_after(60):
                    await first_chunk.wait()
                hurt()
                with trio.fail_after(within):  # the failure cancels the body of running()
                    await trio.sleep_forever()
    return raised, failures, sid


async def test_a_killed_child_fails_pending_and_later_calls() -> None:
    service = await start(TOY, **TINY)
    killed_at = 0.0

    def kill() -> None:
        nonlocal killed_at
        killed_at = time.monotonic()
        os.kill(service.pid, signal.SIGKILL)

    raised, failures, sid = await _until_lost(service, kill, within=5)
    assert time.monotonic() - killed_at < 5
    assert "exited unexpectedly with code -9" in str(raised.value)
    assert len(failures) == 1 and "exited unexpectedly with code -9" in str(failures[0])
    with pytest.raises(ProcessServiceFailed, match="code -9"):
        await service.push_control(sid, Control(ControlType.RESET))
    with pytest.raises(ProcessServiceFailed, match="code -9"):
        await service.chunks(sid).__anext__()
    assert service.exitcode == -9
    assert_no_children()


def _children_of(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


async def test_a_service_that_fails_in_its_process_is_lost_naming_its_failure() -> None:
    """A stage rank of a process-placed toy world killed: the service fails and its process ends (code 0, after
    telling the parent how running() ended). The loss said "exited unexpectedly with code 0", and the stage was lost."""
    placement = {"mode": "process", "encode": {"devices": ["cpu"]}, "denoise": {"devices": ["cpu"]},
                 "decode": {"devices": ["cpu"]}}
    service = await start(TOY, placement=json.dumps(placement), **TINY)

    def kill_the_stages() -> None:
        for rank in _children_of(service.pid):  # the stage ranks, and anything else the service runs
            os.kill(rank, signal.SIGKILL)

    raised, failures, _ = await _until_lost(service, kill_the_stages, within=30)
    assert len(failures) == 1
    assert "the service failed in its process" in str(raised.value), raised.value
    assert "stage '" in str(raised.value) and "exited unexpectedly with code 0" not in str(raised.value), raised.value
    assert_no_children()


async def test_a_killed_service_process_leaves_no_shared_memory_behind() -> None:
    """The service's stages in processes share tensors through /dev/shm, in channels its process made: killed with
    SIGKILL, it unlinked none, and they stayed until the next process that made a channel swept them."""
    placement = {"mode": "process", "encode": {"devices": ["cpu"]}, "denoise": {"devices": ["cpu"]},
                 "decode": {"devices": ["cpu"]}}
    service = await start(TOY, placement=json.dumps(placement), **TINY)
    pid = service.pid

    def segments() -> list[str]:
        return [name for name in os.listdir("/dev/shm") if name.startswith(f"cl_{pid}-")]

    def kill() -> None:
        assert segments(), "the service's channels hold shared memory"
        os.kill(pid, signal.SIGKILL)

    raised, _, _ = await _until_lost(service, kill, within=30)
    assert "code -9" in str(raised.value)
    assert segments() == []
    assert_no_children()


async def test_startup_failures_carry_the_child_traceback(tmp_path: Path) -> None:
    with pytest.raises(ProcessServiceStartError) as missing:
        await start(str(tmp_path / "nope.py"))
    assert "does not exist" in str(missing.value) and "child traceback" in str(missing.value)

    broken = tmp_path / "broken_pipeline.py"
    broken.write_text("def get_service(gpu_num=0):\n    raise RuntimeError('no weights here (test)')\n")
    with pytest.raises(ProcessServiceStartError) as raised:
        await start(str(broken), gpu_num=0)
    text = str(raised.value)
    assert "no weights here (test)" in text and "Traceback (most recent call last)" in text
    assert_no_children()


async def test_replay_server_push_through_the_proxy() -> None:
    service = await start("pipelines/replay")
    assert isinstance(service, ProcessServerPushService) and isinstance(service, ServerPushService)
    options = {"width": 32, "height": 16, "fps": 8, "frames_per_chunk": 4, "duration_seconds": 1.0}
    async with service.running():
        with trio.fail_after(10):
            chunks = [chunk async for chunk in service.stream(SessionConfig(options=options))]
            assert [c.index for c in chunks] == [0, 1]
            for chunk in chunks:
                assert chunk.frames.shape == (4, 16, 32, 3)
                assert chunk.audio is not None and chunk.audio.samples_per_channel == 4 * 48000 // 8
                assert chunk.metadata["source"] == "test_pattern"
            # closing a stream early frees the service's one session for the next stream
            stream = service.stream(SessionConfig(options=options))
            await stream.__anext__()
            await stream.aclose()
            again = [chunk.index async for chunk in service.stream(SessionConfig(options=options))]
            assert again == [0, 1]
            with pytest.raises(RemoteServiceError, match="unknown option"):
                await service.stream(SessionConfig(options={"colour": "red"})).__anext__()
    assert service.exitcode == 0
    assert_no_children()


async def test_model_worker_in_process_mode_uses_a_child() -> None:
    ready: list[int] = []
    worker = ModelWorker(
        "worker-0",
        pipeline="pipelines/replay",
        gpu_ids=(),
        max_sessions=1,
        on_ready=lambda w, capacity, plan: (ready.append(capacity), w.stop()),
        on_failed=lambda w, reason: pytest.fail(reason),
        worker_mode="process",
    )
    with trio.fail_after(20):
        await worker.run()
    assert ready == [1]
    assert isinstance(worker.service, ProcessServerPushService) and worker.service.exitcode == 0
    assert_no_children()


STUCK_PIPELINE = """
import time
from contextlib import asynccontextmanager
from pipelines.contract import ServerPushService

class Stuck(ServerPushService):
    @asynccontextmanager
    async def running(self):
        yield self
        time.sleep(60)  # bench-cost: never leaves running() by itself (a hung pipeline's stand-in)

    def stream(self, config):
        raise NotImplementedError

def get_service(gpu_num=0):
    return Stuck()
"""


async def test_a_child_stuck_on_close_is_terminated_in_bounded_time(tmp_path: Path) -> None:
    close_timeout, kill_grace = 0.5, 0.5
    service = await start_written(tmp_path, "stuck_pipeline", STUCK_PIPELINE, close_timeout=close_timeout,
                                  kill_grace=kill_grace)
    # the close waits its timeout, then SIGTERM and SIGKILL a grace apart; the failure guarded is a hang (a child never
    # terminated), so 3 s of slack for a loaded host still tells the two apart
    bounded_by = close_timeout + 2 * kill_grace + 3
    started = time.monotonic()
    with trio.fail_after(bounded_by + 5):
        async with service.running():
            pass
    assert time.monotonic() - started < bounded_by
    # the child ignores SIGTERM (a signal to the whole process group must not kill the model
    # under live sessions), so the escalation ends with SIGKILL
    assert service.exitcode in (-signal.SIGTERM, -signal.SIGKILL)
    assert_no_children()


HANGING_PIPELINE = """
from contextlib import asynccontextmanager

import trio

from pipelines.contract import BidirectionalService


class Hanging(BidirectionalService):
    '''Its loop runs (heartbeats go on) while some calls never finish.'''

    @asynccontextmanager
    async def running(self):
        yield self

    async def create_session(self, config, *, on_event=None):
        if config.prompt == "hang":
            await trio.sleep_forever()  # a model that never gets its session ready
        return "s-1"

    async def push_control(self, session_id, control):
        await trio.sleep_forever()  # a control queue that never drains

    def chunks(self, session_id):
        return self._none()

    async def _none(self):
        await trio.sleep_forever()
        yield

    async def close_session(self, session_id):
        return None


def get_service(gpu_num=0):
    return Hanging()
"""


async def test_a_call_the_child_never_answers_fails_at_its_own_deadline(tmp_path: Path) -> None:
    deadlines = CallDeadlines(push_control=0.5, create_session=1.0)
    # its loop runs, so the heartbeat (10 s) never fires
    service = await start_written(tmp_path, "hanging_pipeline", HANGING_PIPELINE, call_deadlines=deadlines)
    async with service.running():
        sid = await service.create_session(SessionConfig())
        started = time.monotonic()
        with trio.fail_after(5), pytest.raises(ProcessServiceCallTimeout) as late:
            await service.push_control(sid, Control(ControlType.RESET))
        assert 0.5 <= time.monotonic() - started < 5
        assert (late.value.method, late.value.deadline) == ("push_control", 0.5)
        assert "push_control() got no answer" in str(late.value) and "0.5 s" in str(late.value)
        # the deadline is the call's own: create_session has a longer one, and the child keeps serving
        started = time.monotonic()
        with trio.fail_after(5), pytest.raises(ProcessServiceCallTimeout, match=r"create_session\(\).* 1 s"):
            await service.create_session(SessionConfig(prompt="hang"))
        assert time.monotonic() - started >= 1.0
        await service.close_session(sid)
        assert service.failure is None
    assert service.exitcode == 0
    assert_no_children()


async def test_a_stopped_child_fails_the_call_at_its_deadline_before_the_heartbeat() -> None:
    service = await start(
        "pipelines/replay", call_deadlines=CallDeadlines(running=0.5), heartbeat_timeout=30,
        close_timeout=0.5, kill_grace=0.5,
    )
    os.kill(service.pid, signal.SIGSTOP)  # the child cannot answer Run: running() is never entered
    started = time.monotonic()
    with trio.fail_after(10), pytest.raises(ProcessServiceCallTimeout) as late:
        async with service.running():
            pytest.fail("running() was entered by a stopped child")
    assert time.monotonic() - started < 5  # the deadline, then the bounded stop (a stopped child takes SIGKILL)
    assert (late.value.method, late.value.deadline) == ("running", 0.5)
    assert "running() got no answer" in str(late.value)
    assert service.exitcode == -signal.SIGKILL
    assert_no_children()


def test_call_deadlines_are_seconds_above_zero() -> None:
    with pytest.raises(ValueError, match=r"call_deadlines.push_control must be a number of seconds > 0, got 0"):
        CallDeadlines(push_control=0)
    with pytest.raises(ValueError, match="call_deadlines.running"):
        CallDeadlines(running=float("inf"))
    # under a room runner its own deadline for the same call comes first (its cause is the one recorded)
    defaults = CallDeadlines()
    runner = {"create_session": CREATE_PIPELINE_TIMEOUT, "push_control": CONTROL_TIMEOUT,
              "close_session": CLOSE_PIPELINE_TIMEOUT}
    assert all(defaults.of(call) > seconds for call, seconds in runner.items())
