"""A pipeline's ``sys.exit()``, ``KeyboardInterrupt`` or ``BaseException`` of its own, raised by one of its calls,
is its bug: it fails what the pipeline was serving, naming what it did, and the server serves on.

Such an exception is not an ``Exception``, and under the server it went up past every ``except Exception`` to the
app: a ``sys.exit(3)`` in ``chunks()`` ended its session ``done``/``completed`` (error null), stopped the runtime
(every create after it a 500 ``Nursery is closed to new arrivals``, the failed create's record holding the slot) while
health said ``healthy``; in ``check_options`` it was a 500 with an empty body; in ``running()`` the worker stayed
``starting`` for good. Through the app's HTTP API and the local room protocol, on virtual time.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from pipelines.contract import Chunk, Control, SessionConfig
from server.process_service import start_process_service

from .runner_fixtures import CounterService, join, no_threads, serve, settings, wait_until  # noqa: F401


class Abort(BaseException):
    """A pipeline's own BaseException."""


def raise_(exit_kind: str) -> None:
    if exit_kind == "sys.exit":
        sys.exit(3)
    if exit_kind == "KeyboardInterrupt":
        raise KeyboardInterrupt
    if exit_kind == "GeneratorExit":  # not one met closing a generator: it raises it
        raise GeneratorExit("out of here")
    raise Abort("out of here")


WORDS = {
    "sys.exit": "pipeline bug: {call} called sys.exit(3)",
    "KeyboardInterrupt": "pipeline bug: {call} raised KeyboardInterrupt (no Ctrl-C reaches a pipeline: the server "
                         "takes its stop signals itself)",
    "Abort": "pipeline bug: {call} raised Abort: out of here, a BaseException that is not an Exception",
    "GeneratorExit": "pipeline bug: {call} raised GeneratorExit: out of here, a BaseException that is not an Exception",
}
#: how the session's error names the call (the session's own run names no call: create_session or chunks() or ...)
CALLS = {"create_session": "the pipeline", "chunks": "the pipeline", "push_control": "push_control",
         "close_session": "close_session"}
WHERE = f" (at {__name__.rsplit('.', 1)[-1]}.py, line "  # the line that raised it, in the pipeline's file


class ExitsIn(CounterService):
    """A counter that exits, as ``exit_kind`` says, in its call named ``where`` (for the first session only)."""

    def __init__(self, where: str, exit_kind: str) -> None:
        super().__init__()
        self.where, self.exit_kind, self.exited = where, exit_kind, False

    def _maybe_exit(self, where: str) -> None:
        if where == self.where and not self.exited:
            self.exited = True
            raise_(self.exit_kind)

    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        self._maybe_exit("create_session")
        return await super().create_session(config, on_event=on_event)

    async def push_control(self, session_id: str, control: Control) -> None:
        self._maybe_exit("push_control")
        await super().push_control(session_id, control)

    def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        return self._exiting(super().chunks(session_id))

    async def _exiting(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        async for chunk in chunks:
            if chunk.index == 2:
                self._maybe_exit("chunks")
            yield chunk

    async def close_session(self, session_id: str) -> None:
        self._maybe_exit("close_session")
        await super().close_session(session_id)

    async def check_options(self, options: dict[str, Any]) -> None:
        if options.get("exit"):
            self._maybe_exit("check_options")


EXITS = ["sys.exit", "KeyboardInterrupt", "Abort", "GeneratorExit"]


@pytest.mark.usefixtures("no_threads")
@pytest.mark.parametrize("exit_kind", EXITS)
@pytest.mark.parametrize("where", ["create_session", "chunks", "push_control", "close_session"])
async def test_a_pipeline_that_exits_in_a_call_fails_that_session_and_the_server_serves_on(
    where: str, exit_kind: str, autojump_clock: Any
) -> None:
    service = ExitsIn(where, exit_kind)
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            if where in ("push_control", "close_session"):  # its pipeline session made
                await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            if where == "push_control":
                await ctl.control({"type": "control_state", "controls": ["w"]})
            if where == "close_session":
                status, _ = await s.json("delete", f"/v1/stream/sessions/{created['session_id']}")
                assert status in (200, 202)
            (error,) = await ctl.wait_for(lambda p: p.status("error"), "an error message")
        view = await s.get(created["session_id"])
        assert view["status"] == "failed" and view["error"] == error["detail"], (view, error)
        said = WORDS[exit_kind].format(call=CALLS[where]) + WHERE
        if where == "close_session":  # as any error of its close is said
            assert error["reason"] == "session_failed", error
            assert error["detail"].startswith(f"closing the pipeline session failed: {said}"), error
        else:
            assert error["reason"] == "pipeline_failed", error
            assert error["detail"].startswith(said), error
        assert not any(m.get("type") == "done" for m in ctl.texts())  # it had ended "completed"
        await wait_until(lambda: s.free_slots() == 1, "the slot to be free")
        # the server serves on: the next session runs (every create after the exit had been a 500)
        again = await s.create("ctl-2")
        async with join(s, again["room"], again["token"]) as ctl2:
            await ctl2.wait_for(lambda p: len(p.status("chunk")) >= 3, "three chunks of the next session")
        assert s.runtime.health()["status"] == "healthy"


@pytest.mark.usefixtures("no_threads")
@pytest.mark.parametrize("exit_kind", EXITS)
async def test_a_check_that_exits_is_a_pipeline_bug_answered_in_words(exit_kind: str, autojump_clock: Any) -> None:
    """It was a 500 with an empty body; now the 503 any other bug of a check gets, naming it, and the next create
    is served."""
    async with serve(settings(), ExitsIn("check_options", exit_kind)) as s:
        status, body = await s.json("post", "/v1/stream/sessions", json={"identity": "c", "config": {"exit": True}})
        said = WORDS[exit_kind].format(call="check_options") + WHERE
        assert status == 503 and said in body["detail"], (status, body)
        created = await s.create("ctl")
        assert created["session_id"]


class ExitsInRunning(CounterService):
    @asynccontextmanager
    async def running(self) -> AsyncIterator[CounterService]:
        sys.exit(9)
        yield self


@pytest.mark.usefixtures("no_threads")
async def test_a_pipeline_that_exits_in_running_fails_its_worker_saying_so(autojump_clock: Any) -> None:
    """The worker stayed ``starting`` for good, every create a 503 ``every worker is starting``, no line saying why."""
    async with serve(settings(), ExitsInRunning(), ready=False) as s:

        def said() -> bool:
            return "pipeline bug: running() called sys.exit(9)" in (s.runtime.health()["worker_slots"]["worker-0"]["reason"] or "")

        await wait_until(said, "the worker's slot to say why it failed")
        status, body = await s.json("post", "/v1/stream/sessions", json={"identity": "c"})
        assert status == 503 and "every worker is starting" not in body["detail"], (status, body)


# -- the same in a worker process (``--worker-mode process``): the child exited 1, the code and the cause lost -----

EXITING_PIPELINE = """
import sys
from contextlib import asynccontextmanager

import numpy as np
import trio

from pipelines.contract import BidirectionalService, Chunk

EXIT_IN_RUNNING = {in_running}


class ExitsOnce(BidirectionalService):
    def __init__(self):
        self.sessions = 0

    @asynccontextmanager
    async def running(self):
        if EXIT_IN_RUNNING:
            sys.exit(9)
        yield self

    async def create_session(self, config, *, on_event=None):
        self.sessions += 1
        return f"s{{self.sessions}}"

    async def push_control(self, session_id, control):
        pass

    async def chunks(self, session_id):
        for index in range(1000):
            if index == 2 and session_id == "s1":
                sys.exit(3)
            yield Chunk(index, np.full((2, 16, 16, 3), 100, np.uint8), 10.0)
            await trio.sleep(0.05)  # bench-cost: the worker process's stream, paced

    async def close_session(self, session_id):
        pass


def get_service(gpu_num=0):
    return ExitsOnce()
"""


async def test_a_pipeline_in_a_worker_process_that_exits_fails_only_its_session(tmp_path: Path) -> None:
    path = tmp_path / "exiting_pipeline.py"
    path.write_text(EXITING_PIPELINE.format(in_running=False))
    async with serve(settings(pipeline=str(path), worker_mode="process"), start_process_service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            (error,) = await ctl.wait_for(lambda p: p.status("error"), "an error message", timeout=60.0)
        assert error["reason"] == "pipeline_failed", error
        assert error["detail"].startswith("pipeline bug: the pipeline called sys.exit(3) (at exiting_pipeline.py, line "), error
        await wait_until(lambda: s.free_slots() == 1, "the slot to be free")
        again = await s.create("ctl-2")  # the same worker process serves on
        async with join(s, again["room"], again["token"]) as ctl2:
            await ctl2.wait_for(lambda p: len(p.status("chunk")) >= 3, "three chunks of the next session", timeout=60.0)
        assert [worker.failure for worker in s.runtime.workers.values()] == [None]


async def test_a_pipeline_in_a_worker_process_that_exits_in_running_is_told_and_not_restarted_for_ever(
    tmp_path: Path
) -> None:
    """The slot's reason named the child's pid and exit code 1 (so each replacement's failure read as new: restarted 5
    times where in-process stops after 2), or read ``running() failed in the child process:`` and no more."""
    path = tmp_path / "exiting_pipeline.py"
    path.write_text(EXITING_PIPELINE.format(in_running=True))
    async with serve(settings(pipeline=str(path), worker_mode="process"), start_process_service, ready=False) as s:

        def given_up() -> bool:
            slot = s.runtime.health()["worker_slots"]["worker-0"]
            return slot["state"] == "gave_up"

        await wait_until(given_up, "the slot to give up", deadline=120.0)
        slot = s.runtime.health()["worker_slots"]["worker-0"]
        assert "pipeline bug: running() called sys.exit(9) (at exiting_pipeline.py, line " in slot["reason"], slot
        assert "failed the same way twice in a row" in slot["reason"] and slot["restarts"] == 1, slot
