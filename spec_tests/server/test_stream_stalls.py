"""A server-push stream that stops giving chunks fails its session as a stalled pipeline, and frees the slot.

It stayed ``running`` with no frame until ``session_timeout`` (30 min by default), holding its worker's one slot (a
server-push service has exactly one retained session): every other create was a 429 meanwhile. Now each chunk has a
deadline (``server.pushed_stream``): the first the create's, every later one ``CHUNK_STALL_TIMEOUT``; past it the
session fails ``pipeline_stalled`` naming the chunk, its clients hear it on ``tf.status`` and the next create is
admitted. Through the app's HTTP API and a room socket, on trio's autojump clock.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from pipelines.contract import Chunk, ServerPushService, SessionConfig
from server.run_command import run_deadlines
from server.runner import CHUNK_STALL_TIMEOUT, CREATE_PIPELINE_TIMEOUT

from .runner_fixtures import join, no_threads, serve, settings  # noqa: F401  (no_threads: fixture)
from ..virtual_time import elapse_until

pytestmark = pytest.mark.usefixtures("no_threads")


class StallingStream(ServerPushService):
    """Gives ``chunks`` chunks, each ``pause`` seconds after it is asked for, then none for ever."""

    takes_prompt = takes_image = False

    def __init__(self, chunks: int, pause: float = 0.0) -> None:
        self.chunks, self.pause = chunks, pause
        self.closed = trio.Event()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[StallingStream]:
        yield self

    async def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        try:
            for index in range(self.chunks):
                await trio.sleep(self.pause)  # bench-cost: the stream's time to make a chunk, on the autojump clock
                yield Chunk(index=index, frames=np.zeros((1, 16, 16, 3), np.uint8), fps=4.0)
            await trio.sleep_forever()
        finally:
            self.closed.set()


async def until(t: float) -> None:
    await elapse_until(t)
    await wait_all_tasks_blocked()


@pytest.mark.parametrize(("given", "deadline"), [(1, CHUNK_STALL_TIMEOUT), (0, CREATE_PIPELINE_TIMEOUT)],
                         ids=["after_its_first_chunk", "before_its_first_chunk"])
async def test_a_stream_that_stops_giving_chunks_fails_its_session_as_stalled_and_frees_the_slot(
    given: int, deadline: float, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="chunkline")
    service = StallingStream(given)
    async with serve(settings(queue_size=0), service) as s:
        created = await s.create("ctl")
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "running")
            if given:
                await ctl.wait_for(lambda p: p.status("chunk"), "chunk 0")
            asked = trio.current_time()  # the stream is asked for its next chunk as the last one went out
            await until(asked + deadline - 1)
            assert (await s.get(session_id))["status"] == "running"
            await until(asked + deadline + 1)
            record = await s.get(session_id)
            told = f"the pipeline stalled: chunk {given} of its stream did not come within {deadline:g} s"
            assert record["status"] == "failed" and record["drain_cause"] == "pipeline_stalled", record
            assert record["error"] == told
            # the log says so too (a failure that ends the run by a cancel went unlogged)
            assert f"session {session_id} failed: {told}" in caplog.messages
            (error,) = await ctl.wait_for(lambda p: p.status("error"), "the error on tf.status")
            assert error["reason"] == "pipeline_stalled" and error["detail"] == told
        assert service.closed.is_set()  # the stream was closed
        assert s.free_slots() == 1 and not s.runtime.runners
        assert (await s.json("post", "/v1/stream/sessions", json={"identity": "next"}))[0] == 200


async def test_a_slow_stream_whose_every_chunk_comes_within_the_deadline_runs_on(autojump_clock: Any) -> None:
    """The deadline is per chunk, not for the stream: chunks each just inside it keep the session running."""
    service = StallingStream(4, pause=CHUNK_STALL_TIMEOUT - 2)
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: len(p.status("chunk")) == 4, "four chunks", timeout=5 * CHUNK_STALL_TIMEOUT)
            assert (await s.get(created["session_id"]))["status"] == "running"


def test_chunkline_run_stalls_by_the_server_s_own_constant() -> None:
    """One source: ``chunkline run`` takes the server's numbers, not its own."""
    deadlines = run_deadlines()
    assert (deadlines.chunk, deadlines.create_session) == (CHUNK_STALL_TIMEOUT, CREATE_PIPELINE_TIMEOUT)
