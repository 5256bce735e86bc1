"""The 32 viewer seats hold on LiveKit for a session run by a worker agent: a viewer that comes back over the seats
with its still-valid token is removed by the authority, which holds the seats from the agent's reports
(``server/cluster/seat_reports.py``), and only by it.

An agent's runner saw the joiner over the seats but could not remove it (its transport holds no API key), so the
viewer stayed, the room over its seats, with a warning in the agent's log; and the authority, which hears who is in
the room from the agent, never spent a joiner's token pass, so a viewer that left held its seat until its token
expired (a new viewer was refused ``viewer_limit`` with a seat free). Now the authority checks each joiner the agent
reports with the seat rule its own workers use, spends its pass, and removes one over the seats through its
RoomService; the agent checks nothing. ``chunkline stream-serve --workers local`` with one agent process inside the
namespace, a real LiveKit server, real SDK clients for the controller and 33 viewers (the scenario:
``seat_returner.py``); who is in the room reaches the authority over the network, and every wait is bounded.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from server.livekit_clients import Clients as Agent
from server.viewer_seats import MAX_VIEWERS_PER_SESSION

from .conftest import SESSIONS, StreamServer
from .seat_returner import a_viewer_comes_back_over_the_seats

pytestmark = pytest.mark.livekit


async def test_a_viewer_coming_back_over_the_seats_of_an_agents_session_is_removed_by_the_authority(
    stream_servers: Callable[..., StreamServer], agent: Agent
) -> None:
    stream = stream_servers(workers="local", num_workers=1, cluster_port=0, max_sessions_per_worker=1, queue_size=1,
                            controller_timeout=60, room_empty_timeout=60)
    session_id, _, returner = await a_viewer_comes_back_over_the_seats(stream, agent)
    async with stream.http() as http:
        record = (await http.get(f"{SESSIONS}/{session_id}")).json()
        workers = (await http.get("/v1/stream/health")).json()["workers"]
    assert [w["launcher"] for w in workers if w["worker_id"] == record["worker_id"]] == ["local"], workers
    log = stream.log.read_text(errors="replace")
    removal = f"session {session_id}: viewer '{returner}' joined over the {MAX_VIEWERS_PER_SESSION} viewer seats"
    assert log.count(removal) == 1, stream.log_tail()  # the authority's line, once: the agent did not try as well
    assert "over the seats stays in the room" not in log, stream.log_tail()
