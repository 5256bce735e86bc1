"""The 32 viewer seats hold on LiveKit too: a viewer that joins a session's room over its seats is removed by the
server, the newest joiner, never the controller (``server/viewer_seats.py``).

On LiveKit, LiveKit is the door: a viewer that left and came back with its still-valid token (tokens live
``--token-ttl``, an hour by default) was let in with 32 other viewers in the room, and nothing sent it away, so a
room could hold many more than 32 viewers (tokens handed out while seats were free, then all used at once). Now the
session's worker asks at each join whether the joiner holds a seat and, if not, removes it through LiveKit's
RoomService. A viewer the worker saw join spends its token's seat at once, too: its token held the seat until it
expired (an hour) when the viewer left before the next token request, and a new viewer was refused ``viewer_limit``
with a seat free. ``chunkline stream-serve`` with in-process workers, a real LiveKit server, real SDK clients inside the
namespace for the controller and 33 viewers (cheap ones: no subscription); the test reads the session over HTTP and
the room through the RoomService, each wait bounded by a deadline (the scenario: ``seat_returner.py``, shared with
the agent-hosted session's test, ``test_agent_viewer_seats.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from server.livekit_clients import Clients as Agent
from server.viewer_seats import MAX_VIEWERS_PER_SESSION

from .conftest import StreamServer
from .seat_returner import a_viewer_comes_back_over_the_seats

pytestmark = pytest.mark.livekit


async def test_a_viewer_coming_back_over_the_seats_is_removed_from_the_livekit_room(
    stream_servers: Callable[..., StreamServer], agent: Agent
) -> None:
    stream = stream_servers(controller_timeout=60, room_empty_timeout=60)
    session_id, _, returner = await a_viewer_comes_back_over_the_seats(stream, agent)
    removal = f"session {session_id}: viewer '{returner}' joined over the {MAX_VIEWERS_PER_SESSION} viewer seats"
    assert stream.log.read_text(errors="replace").count(removal) == 1, stream.log_tail()  # one join, one removal
