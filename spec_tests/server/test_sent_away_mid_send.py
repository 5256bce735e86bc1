"""A participant sent away while one of its messages is being sent is still told why.

A socket's send (a trio channel's, a TCP stream's) can deliver its message and then yield before it returns. If the
worker sent the participant away in that gap (a viewer over its seats) or the server's backlog did (too slow), the
sent message's removal took the refusal that had replaced the queue: the socket closed with no ``refused`` at all
(seen in CI: a viewer sent away with ``viewer_limit`` waited for the refusal until it timed out).

The local rooms as the room socket drives them (``LocalRooms.serve_client`` with the socket's send and receive), a
worker connected through the transport; the send here delivers, then waits to be let go, so the gap is held open.
"""

from __future__ import annotations

import json

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from server.tokens import TokenIssuer
from server.transport.local import LocalRooms
from server.transport.local_room import TEXT_BACKLOG

ROOM = "r"


class HeldSend:
    """A socket's send that, once armed, delivers its next message and then yields until let go."""

    def __init__(self) -> None:
        self.sent: list[str | bytes] = []
        self.armed = False
        self.holding = trio.Event()
        self.let_go = trio.Event()

    async def __call__(self, message: str | bytes) -> None:
        self.sent.append(message)  # delivered
        if self.armed:
            self.armed = False
            self.holding.set()
            with trio.CancelScope(shield=True):  # a delivered send is not undone by a cancel
                await self.let_go.wait()

    def texts(self) -> list[dict]:
        return [json.loads(m) for m in self.sent if isinstance(m, str)]


@pytest.mark.parametrize("sent_away_by", ["the worker", "the backlog"])
async def test_a_participant_sent_away_while_a_message_is_being_sent_is_told_why(sent_away_by: str) -> None:
    issuer = TokenIssuer("chunkline-test", "s" * 48, ttl_seconds=600)
    rooms = LocalRooms(issuer)
    send = HeldSend()
    _, silent = trio.open_memory_channel[str](0)  # the viewer says nothing
    served = trio.Event()

    async def viewer() -> None:
        await rooms.serve_client(ROOM, rooms.admit_client(ROOM, issuer.viewer_token(ROOM, "v1")), send, silent.receive)
        served.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(viewer)
            await wait_all_tasks_blocked()
            worker = await rooms.connect(ROOM, "chunkline-w", issuer.worker_token(ROOM, "chunkline-w"), timeout=5)
            await wait_all_tasks_blocked()
            send.armed = True
            await worker.send_data("tf.status", b'{"type": "status"}', to="v1")
            await send.holding.wait()  # delivered; the send has not returned yet
            if sent_away_by == "the worker":
                await worker.send_away("v1", "viewer_limit", "all 32 viewer seats are taken")
                why = {"type": "refused", "reason": "viewer_limit", "detail": "all 32 viewer seats are taken"}
            else:
                for index in range(TEXT_BACKLOG):  # the viewer's queue fills past its bound: too slow
                    await worker.send_data("tf.status", json.dumps({"n": index}).encode(), to="v1")
                why = {"type": "refused", "reason": "too_slow"}
            send.let_go.set()
            await served.wait()
            await worker.disconnect()
    last = send.texts()[-1]
    assert {key: last.get(key) for key in why} == why, send.texts()[-3:]
    assert [m for m in send.texts() if m.get("type") == "refused"] == [last]  # told once
