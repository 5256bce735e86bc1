"""The LiveKit server goes away: a session fails with the transport's reason, in bounded time, and frees
its slot; a session started while the server is unreachable fails within the connect timeout.

This module kills its own LiveKit server, so it has one of its own (the fixture is per module).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

from server.runner import CONNECT_TIMEOUT

from server.livekit_clients import Clients as Agent

from .conftest import LiveKit, StreamServer
from .test_stream import TERMINAL, create, health, wait_status

pytestmark = pytest.mark.livekit

LOSS_BOUND = 10.0  # s from the server's death to the session's failure: the transport waits 5 s for a reconnection


async def test_the_livekit_server_dying_fails_the_session_and_frees_its_slot(
    livekit_server: LiveKit, stream_servers: Callable[..., StreamServer], agent: Agent
) -> None:
    stream = stream_servers(controller_timeout=60, room_empty_timeout=60, max_sessions_per_worker=1)
    created = await create(stream, "hank")
    await agent.join("hank", created["token"])
    await agent.wait_message("hank", "status", stage="running")
    await agent.request("hold", client="hank", keys=["d"], period=0.1)
    await agent.wait_frames("hank", 8)

    livekit_server.process.kill()
    killed_at = trio.current_time()
    ended = await wait_status(stream, created["session_id"], TERMINAL, timeout=LOSS_BOUND + 5)
    took = trio.current_time() - killed_at
    assert ended["status"] == "failed", ended
    assert "LiveKit" in ended["error"], ended
    assert took < LOSS_BOUND, took
    assert (await health(stream))["free_slots"] == 1

    # with the server gone, the next session cannot join its room: it fails within the connect timeout
    second = await create(stream, "ivy")
    started = trio.current_time()
    failed = await wait_status(stream, second["session_id"], TERMINAL, timeout=CONNECT_TIMEOUT + 10)
    assert failed["status"] == "failed", failed
    assert "could not connect to LiveKit" in failed["error"], failed
    assert trio.current_time() - started < CONNECT_TIMEOUT + 3
    assert (await health(stream))["free_slots"] == 1
