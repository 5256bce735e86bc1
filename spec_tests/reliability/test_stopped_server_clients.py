"""A server process that was stopped (SIGSTOP, then SIGCONT: a paused VM does the same) does not blame its room
clients for the stop: a controller that answered every ping was closed as silent (``no answer to pings for 15 s``)
as the server went on, and never heard why. Its deadlines leave out the time it did not run, as they leave out a
loop a pipeline held. A real ``chunkline stream-serve``, a real stop.
"""

from __future__ import annotations

import os
import signal

import httpx
import trio

from server.room_socket import PONG_DEADLINE
from server.transport.client import RoomClient

from .test_held_loop_stops import Server

STOPPED = PONG_DEADLINE + 3.0  # longer than a peer may stay silent


async def test_a_stopped_server_does_not_send_away_a_room_client_that_answered_every_ping() -> None:
    server = Server(["-m", "server.cli", "stream-serve", "pipelines/toy_world", "--port", "0"],
                    pipeline="pipelines/toy_world")
    try:
        url = await trio.to_thread.run_sync(server.ready)
        created = (await trio.to_thread.run_sync(lambda: httpx.post(f"{url}/v1/stream/sessions",
                                                                    json={"identity": "ctl"}, timeout=30))).json()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        controller = await RoomClient.connect(host, int(port), f"{created['websocket_path']}?token={created['token']}")
        got: list[object] = []

        async def read() -> None:  # answers every ping as it reads
            while (message := await controller.receive()) is not None:
                got.append(message)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            with trio.fail_after(30):
                while not any(isinstance(m, bytes) for m in got):  # frames: the session runs
                    await trio.sleep(0.05)  # bench-cost: a real server's frames come in their own time
            os.kill(server.popen.pid, signal.SIGSTOP)
            try:
                await trio.sleep(STOPPED)  # bench-cost: the stop must outlast the pong deadline
            finally:
                os.kill(server.popen.pid, signal.SIGCONT)
            before = len(got)
            with trio.fail_after(30):
                while len(got) < before + 20:  # it streams on to the same client
                    assert not controller.closed, server.log.decode(errors="replace")[-3000:]
                    await trio.sleep(0.05)  # bench-cost: as above
            nursery.cancel_scope.cancel()
        await controller.aclose()
        assert b"no answer to pings" not in server.log, server.log.decode(errors="replace")[-3000:]
    finally:
        server.end()
