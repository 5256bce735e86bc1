"""The server's last log line of a shutdown says how its sessions ended: drained, or stopped at once past the grace.

It said ``shutdown complete: 1 session(s) drained`` for a session whose drain outlasted the grace (its stream's
cleanup took longer) and which was stopped at once when the grace ran out; an operator reading it took that session
for drained. Through the app and a room socket, on trio's autojump clock.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio

from pipelines.contract import Chunk, ServerPushService, SessionConfig

from .runner_fixtures import join, no_threads, serve, settings  # noqa: F401  (no_threads: fixture)

pytestmark = pytest.mark.usefixtures("no_threads")

GRACE = 5.0  # under the stream's cleanup, and under the runner's close deadline: the drain outlasts the grace


class OneChunkThenSilence(ServerPushService):
    """Gives chunk 0, then waits; its cleanup, as the stream is closed, takes three graces."""

    takes_prompt = takes_image = False

    @asynccontextmanager
    async def running(self) -> AsyncIterator[OneChunkThenSilence]:
        yield self

    async def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        try:
            yield Chunk(index=0, frames=np.zeros((1, 16, 16, 3), np.uint8), fps=4.0)
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(3 * GRACE)  # bench-cost: the stream cleanup's cost, on the autojump clock


async def test_a_session_stopped_at_once_past_the_grace_is_not_logged_as_drained(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="chunkline")
    async with serve(settings(), OneChunkThenSilence()) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "chunk 0")
            started = trio.current_time()
            await s.runtime.shutdown(GRACE)
            assert trio.current_time() - started >= GRACE  # it waited the grace out, then stopped the session
    assert "shutdown complete: 0 session(s) drained, 1 stopped at once past the grace" in caplog.messages, caplog.messages
