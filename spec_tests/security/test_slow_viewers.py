"""A viewer that never reads holds a bounded amount of the server's memory, in bytes as well as messages.

A controller's data messages fan out to every other participant of its room. A viewer that stops reading
(handshake done, then nothing) keeps its unsent data messages queued until it is sent away: the queue was
bounded by count alone (1024), so a controller's 12 KiB messages (24 KiB once re-encoded) held 24 MiB for
each such viewer, 32 of them to a session, for as long as the write deadline let them stay. Now the queue is
bounded in bytes too (``TEXT_BACKLOG_BYTES``): past it the viewer is told ``too_slow`` and sent away.

The write and ping deadlines are set long here, so that what sends the viewer away is the queue's bound.

What a controller may legally send must never send an honest viewer, one that reads, away: by count alone its
burst (``DATA_BURST`` messages of 12 KiB, three times that once re-encoded) was 18 MiB, and its own viewers were
sent away ``too_slow``. A participant's data is now paced by what it makes the room send too (``DataPace``): the
last tests run the app in-process on trio's autojump clock, with a viewer that reads at a set speed (its reads
take virtual time), and the controller sending as fast as it is let.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import attrs
import pytest
import trio
from quart.testing.connections import WebsocketDisconnectError
from trio.testing import wait_all_tasks_blocked
from wsproto.events import CloseConnection, TextMessage

from server.transport import data_pace
from server.transport.data_pace import DATA_BURST, DATA_BYTE_BURST, DATA_BYTES_PER_SECOND
from server.transport.local_room import TEXT_BACKLOG, TEXT_BACKLOG_BYTES
from spec_tests.server.runner_fixtures import CounterService, Peer, join, serve, settings
from spec_tests.server.runner_fixtures import no_threads  # noqa: F401  (fixture)

from .test_hostile_server import FAST, WAIT, handshake, running

PATIENT = attrs.evolve(FAST, write=600.0, ping_interval=300.0, pong=600.0, idle=600.0)
#: 12,000 bytes as UTF-8 on the wire (within the data message limit), 24,000 once the server re-encodes it
MESSAGE = json.dumps({"topic": "chat", "payload": "\u2603" * 4000}, ensure_ascii=False)
FLOOD = 480  # with the control_rejected answer to each, 960 messages: under TEXT_BACKLOG by count
assert 2 * FLOOD < TEXT_BACKLOG and FLOOD * 24_000 > 2 * 4194304 + TEXT_BACKLOG_BYTES  # past what the kernel buffers


async def _open(server: Any, target: str, rcvbuf: int | None = None) -> tuple[trio.SocketStream, Any]:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # fills at once: the server's writes wait
    sock.connect((server.host, server.port))
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    return stream, await handshake(stream, target)


async def test_a_viewer_that_never_reads_is_sent_away_once_its_queue_passes_its_byte_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the pace on what the controller makes the room send is not what is tested here (below): no wait on it
    monkeypatch.setattr(data_pace, "DATA_BYTES_PER_SECOND", 1 << 30)
    monkeypatch.setattr(data_pace, "DATA_BYTE_BURST", 1 << 30)
    async with running(deadlines=PATIENT, controller_timeout=3600) as server:
        created = await server.session()
        token = (await server.request("POST", f"/v1/stream/sessions/{created['session_id']}/tokens",
                                      {"identity": "lazy"}))[1]["token"]
        lazy, viewer = await _open(server, f"{created['websocket_path']}?token={token}", rcvbuf=4096)
        flooder, controller = await _open(server, f"{created['websocket_path']}?token={created['token']}")
        async with trio.open_nursery() as nursery:

            async def drain(stream: trio.SocketStream) -> None:
                while await stream.receive_some(1 << 20):
                    pass

            nursery.start_soon(drain, flooder)
            for _ in range(FLOOD):
                await flooder.send_all(controller.send(TextMessage(data=MESSAGE)))
            await flooder.send_all(controller.send(TextMessage(data=json.dumps({"topic": "chat", "payload": "end"}))))
            # the viewer reads at last: what the server kept for it, then its close or the last message
            seen: list[Any] = []
            parts: list[str] = []
            with trio.fail_after(WAIT * 3):
                while not seen or seen[-1] not in ("end", "closed"):
                    data = await lazy.receive_some(1 << 20)
                    viewer.receive_data(data or None)
                    for event in viewer.events():
                        if isinstance(event, TextMessage):
                            parts.append(event.data)
                            if event.message_finished:
                                message = json.loads("".join(parts))
                                parts.clear()
                                seen.append(message.get("payload") if message.get("topic") == "chat" else message)
                        elif isinstance(event, CloseConnection):
                            seen.append("closed")
                    if not data:
                        seen.append("closed")
            nursery.cancel_scope.cancel()
        assert seen[-1] == "closed", "a viewer that never read was kept past its byte bound"
        refused = [m["reason"] for m in seen if isinstance(m, dict) and m.get("type") == "refused"]
        assert refused in ([], ["too_slow"]), refused  # told why when it read in time for the last flush
        await lazy.aclose()
        await flooder.aclose()


#: 12,000 bytes of UTF-8 on the wire (within the data message limit), 36,000 characters once the room re-encodes it
#: (``\\u00e9`` for each): the most text one message can make the room send
WIDEST = json.dumps({"topic": "chat", "payload": "\u00e9" * 6000}, ensure_ascii=False)
#: characters a second the honest viewer reads: a quarter more than a participant's data may make the room send
#: it, for the stream's own messages (its chunks' status, the worker's answers to the chat, counted in the pace)
READ_RATE = DATA_BYTES_PER_SECOND * 1.25


class Reader:
    """A viewer on a link of READ_RATE characters a second: each message it reads takes its length / READ_RATE
    (virtual time) before the next is read, so the server's queue for it holds what the link has not taken."""

    def __init__(self, ws: object, expected: int) -> None:
        self.ws = ws
        self.chat = 0
        self.refused: list[str] = []
        self.expected = expected
        self.done = trio.Event()  # every chat message came, or the viewer was sent away

    async def read(self) -> None:
        try:
            while True:
                raw = await self.ws.receive()  # type: ignore[attr-defined]
                await trio.sleep(len(raw) / READ_RATE)  # bench-cost: the link's speed (virtual on the autojump clock)
                message = json.loads(raw) if isinstance(raw, str) else {}
                if message.get("type") == "refused":
                    self.refused.append(message["reason"])
                elif message.get("topic") == "chat":
                    self.chat += 1
                    if self.chat == self.expected:
                        self.done.set()
        except (WebsocketDisconnectError, trio.EndOfChannel, trio.ClosedResourceError):
            self.refused.append("closed")
        finally:
            self.done.set()


async def running_session(ctl: Peer) -> None:
    await ctl.wait_for(lambda p: "running" in p.stages(), "the session to run")


@pytest.mark.usefixtures("no_threads")  # on the autojump clock a thread's real time would pass as virtual
async def test_a_controllers_largest_legal_burst_sends_no_reading_viewer_away(autojump_clock: Any) -> None:
    """DATA_BURST messages of the widest text, sent as fast as the server takes them: every one reaches a viewer
    that reads a quarter faster than the pace, which stays (by count alone the server took them all at once, and
    the viewer was sent away ``too_slow`` after its first megabyte)."""
    service = CounterService(fps=2, frames_per_chunk=1, size=(8, 8))
    async with serve(settings(), service) as served:
        created = await served.create("ctl")
        token = await served.viewer_token(created["session_id"], "reader")
        async with join(served, created["room"], created["token"]) as ctl, \
                served.client.websocket(f"/v1/rooms/{created['room']}/ws?token={token}") as ws:
            await running_session(ctl)
            reader = Reader(ws, DATA_BURST)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader.read)
                for _ in range(DATA_BURST):
                    await ctl.ws.send(WIDEST)
                with trio.fail_after(3600):
                    await reader.done.wait()
                nursery.cancel_scope.cancel()
    assert reader.refused == [] and reader.chat == DATA_BURST, (reader.refused, reader.chat)


@pytest.mark.usefixtures("no_threads")
async def test_leaving_and_coming_back_buys_a_controller_no_fresh_burst(autojump_clock: Any) -> None:
    """The room keeps each participant's pace while it lives: a controller that reconnects after each burst's worth
    of the widest messages is paced as if it had stayed (a fresh burst for every socket put them all in the
    viewer's backlog at once, and sent it away)."""
    service = CounterService(fps=2, frames_per_chunk=1, size=(8, 8))
    per_burst = DATA_BYTE_BURST // 36_000 + 1
    rounds = 2 * TEXT_BACKLOG_BYTES // DATA_BYTE_BURST  # twice the backlog, were each socket's burst its own
    async with serve(settings(), service) as served:
        created = await served.create("ctl")
        token = await served.viewer_token(created["session_id"], "reader")
        async with served.client.websocket(f"/v1/rooms/{created['room']}/ws?token={token}") as ws:
            reader = Reader(ws, per_burst * rounds)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader.read)
                for turn in range(rounds):
                    async with join(served, created["room"], created["token"]) as ctl:
                        await ctl.wait_for(lambda p: any(m["type"] == "joined" for m in p.texts()), "joined")
                        if turn == 0:
                            await running_session(ctl)  # the worker is in the room: the chat goes to the viewer
                        for _ in range(per_burst):
                            await ctl.ws.send(WIDEST)
                        # the room took them all (the worker answers each: chat is no control) before it leaves
                        await ctl.wait_for(lambda p: len(p.status("control_rejected")) == per_burst, "the answers")
                    await wait_all_tasks_blocked()  # it left the room: its identity is free again
                with trio.fail_after(3600):
                    await reader.done.wait()
                nursery.cancel_scope.cancel()
    assert reader.refused == [] and reader.chat == per_burst * rounds, (reader.refused, reader.chat)
