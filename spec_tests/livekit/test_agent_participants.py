"""An agent-hosted session on a real LiveKit server: who is in its room, as the authority shows it, is the agent's
word (the authority cannot see a LiveKit room itself), sent over the wire as a ``participants`` message when it
changes mid-run, at most one a session every 0.5 s.

``chunkline stream-serve --workers local`` with one agent inside the namespace, real SDK clients for the
controller and a viewer; the test reads the session over HTTP. The agent's report comes from another process
over a real network: the count is polled, bounded by a deadline.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from server.livekit_clients import Clients as Agent

from .conftest import SESSIONS, StreamServer, counted

pytestmark = pytest.mark.livekit


@pytest.fixture(scope="module")
def stream(stream_servers: Callable[..., StreamServer]) -> StreamServer:
    return stream_servers(workers="local", num_workers=1, cluster_port=0, max_sessions_per_worker=1, queue_size=1,
                          controller_timeout=30, room_empty_timeout=30)


async def test_an_agent_hosted_sessions_participants_follow_its_livekit_room(stream: StreamServer, agent: Agent) -> None:
    async with stream.http() as http:
        created = (await http.post(SESSIONS, json={"identity": "alice"})).json()
        session_id = created["session_id"]
        assert created["transport"] == "livekit", created
        await agent.join("alice", created["token"])
        await agent.wait_message("alice", "status", stage="running")
        record = await counted(stream, session_id, 1)
        worker = (await http.get("/v1/stream/health")).json()["workers"]
        assert [w["launcher"] for w in worker if w["worker_id"] == record["worker_id"]] == ["local"], worker
        viewer = (await http.post(f"{SESSIONS}/{session_id}/tokens", json={"identity": "v1"})).json()
        await agent.join("v1", viewer["token"])
        await counted(stream, session_id, 2)  # the agent said who came, mid-run
        await agent.request("leave", client="v1")
        await counted(stream, session_id, 1)  # ... and who left
        again = await http.post(f"{SESSIONS}/{session_id}/tokens", json={"identity": "v1"})
        assert again.status_code == 200, again.text  # the viewer that left may come back
        assert (await http.delete(f"{SESSIONS}/{session_id}")).status_code == 200
        ended = (await http.get(f"{SESSIONS}/{session_id}")).json()
        assert ended["status"] == "closed" and ended["participant_count"] == 0, ended
