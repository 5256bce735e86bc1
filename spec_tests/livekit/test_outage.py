"""The LiveKit server goes away: a session fails with the transport's reason, in bounded time, and frees
its slot; a session asked for while the server is unreachable is refused (503) without holding anything.

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

    # with the server gone, no new session can have a room: the create is refused at once, naming LiveKit, and
    # holds nothing (it was admitted, then failed within the connect timeout, when the worker could not join)
    started = trio.current_time()
    async with stream.http() as http:
        refused = await http.post("/v1/stream/sessions", json={"identity": "ivy"})
        listed = (await http.get("/v1/stream/sessions")).json()["sessions"]
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"] == "transport_unavailable", refused.text
    assert "could not create the LiveKit room" in refused.json()["detail"], refused.text
    assert refused.headers["Retry-After"].isdigit()
    assert trio.current_time() - started < CONNECT_TIMEOUT
    assert [s["session_id"] for s in listed] == [created["session_id"]]
    assert (await health(stream))["free_slots"] == 1
