"""A room socket's close is a handshake: the server sends its close frame and ends the connection once the client's
answers it, not before.

The front shut its write side right after its close frame. A client whose transport closes at the end of the
stream (aiohttp's) often had it closed before its answer went out, and reported 1006, an abnormal closure, for a
session that ended well (4 runs in 8 of "join, DELETE, read to the end"). In-process, on trio's autojump clock,
through the front's own code (``Front.handle``) over an in-memory stream.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from wsproto.events import CloseConnection, TextMessage

from server.front import Front
from server.room_socket import CLOSE_DEADLINE

from spec_tests.server.runner_fixtures import CounterService, serve, settings
from spec_tests.server.runner_fixtures import no_threads  # noqa: F401  (fixture)

from .room_clients import PATIENT, join

pytestmark = pytest.mark.usefixtures("no_threads")


async def test_the_server_ends_the_connection_once_the_client_answered_its_close(autojump_clock: Any) -> None:
    async with serve(settings(), CounterService(fps=2, frames_per_chunk=1, size=(8, 8))) as served:
        front = Front(served.runtime.transport, "unused", max_message_bytes=16384, deadlines=PATIENT)
        async with trio.open_nursery() as nursery:
            created = await served.create("ctl")
            ctl = await join(front, nursery, created, created["token"], read=False)
            status, _ = await served.json("delete", f"/v1/stream/sessions/{created['session_id']}")
            assert status == 200
            events: list[Any] = []
            with trio.fail_after(30):
                while not any(isinstance(event, CloseConnection) for event in events):
                    data = await ctl.stream.receive_some(65536)
                    assert data, f"the connection ended before the close frame: {events[-3:]}"
                    ctl.ws.receive_data(data)
                    events += ctl.ws.events()
            said = [event.data for event in events if isinstance(event, TextMessage)]
            assert any('"done"' in text for text in said), said
            (close,) = [event for event in events if isinstance(event, CloseConnection)]
            assert close.code == 1000
            # the client has not answered yet: the server waits for it (it had shut its side at once)
            with trio.move_on_after(CLOSE_DEADLINE / 2) as waited:
                ended = await ctl.stream.receive_some(65536)
                assert ended, "the server ended the connection before the client answered its close"
            assert waited.cancelled_caught
            await ctl.stream.send_all(ctl.ws.send(close.response()))
            with trio.fail_after(CLOSE_DEADLINE):
                assert await ctl.stream.receive_some(65536) == b""  # then it ends it, at once
            await ctl.stream.aclose()
            front.close()
