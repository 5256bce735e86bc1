"""Many room sockets together are read no faster than one budget for the whole server (``server.frame_budget``).

Each socket's frames were paced on their own (1,000 a second past a burst of 1,000): 64 sockets flooding pings
together took a live session from 16 to 6 fps on a 2-core host (``bench/room_flood.py``). Now every participant
socket is read at its equal share of ``SERVER_FRAMES_PER_SECOND``, past its share of ``SERVER_FRAME_BURST``:
with more sockets open, each floods slower. A real server (the front, real sockets), as in test_hostile_server.
"""

from __future__ import annotations

import trio
from wsproto.events import Ping, Pong

from server.frame_budget import FRAMES_PER_SECOND, SERVER_FRAME_BURST, SERVER_FRAMES_PER_SECOND
from server.room_socket import Deadlines
from server.transport.client import RoomClient

from .test_hostile_server import WAIT, handshake, running

VIEWERS = 16
SOCKETS = VIEWERS + 1  # and the flooding controller
SHARE = SERVER_FRAMES_PER_SECOND / SOCKETS  # frames a second
SHARE_BURST = SERVER_FRAME_BURST // SOCKETS
FLOOD = SHARE_BURST + int(SHARE)  # a second of its share past its burst
# one socket alone (at FRAMES_PER_SECOND past FRAME_BURST) would be answered at once: the flood is within its burst
assert SHARE < FRAMES_PER_SECOND and FLOOD <= 1000


async def test_a_sockets_ping_flood_is_read_at_its_share_of_the_servers_budget() -> None:
    """With SOCKETS participant sockets open, FLOOD pings from one are answered no sooner than its share allows;
    each is answered, and the flooder stays."""
    async with running(Deadlines(write=1.0, ping_interval=0.2, pong=5.0, head=1.0, idle=3.0)) as server:
        created = await server.session()
        viewers: list[RoomClient] = []
        async with trio.open_nursery() as nursery:
            for index in range(VIEWERS):
                status, body = await server.request(
                    "POST", f"/v1/stream/sessions/{created['session_id']}/tokens", {"identity": f"v{index}"})
                assert status == 200, body
                viewer = await server.room(created, body["token"])
                viewers.append(viewer)
                with trio.fail_after(WAIT):
                    joined = await viewer.receive()  # sent once the room holds the socket, its share taken
                assert joined["type"] == "joined", joined
                nursery.start_soon(read_all, viewer)  # answers the server's pings
            stream = await server.raw()
            ws = await handshake(stream, f"{created['websocket_path']}?token={created['token']}")
            started = trio.current_time()
            await stream.send_all(ws.send(Ping(b"f")) * FLOOD)
            pongs = 0
            with trio.fail_after(WAIT):
                while pongs < FLOOD:
                    data = await stream.receive_some(65536)
                    assert data, "the server closed the socket"
                    ws.receive_data(data)
                    pongs += sum(isinstance(event, Pong) for event in ws.events())
            elapsed = trio.current_time() - started
            assert elapsed >= (FLOOD - SHARE_BURST) / SHARE, f"{FLOOD} pings answered in {elapsed:.2f} s"
            await stream.aclose()
            nursery.cancel_scope.cancel()
        for viewer in viewers:
            await viewer.aclose()


async def read_all(room: RoomClient) -> None:
    while await room.receive() is not None:
        pass
