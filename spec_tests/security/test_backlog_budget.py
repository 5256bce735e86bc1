"""The text queued for every room socket together is bounded: frozen viewers are sent away, an honest one stays.

Each socket's queue was bounded on its own (1 MiB), nothing bounded them together: 1,024 frozen viewers could make
the server hold 1 GiB. Now all sockets' queued text is at most ``SERVER_BACKLOG_BYTES`` (64 MiB), read through the
``chunkline_room_queued_bytes`` gauge, and past it the sockets behind the longest (whose oldest unsent text has waited
longest) are sent away ``too_slow`` first: frozen ones, not a reader that holds a legal burst for a moment.

The app runs in-process on trio's autojump clock; each room socket is a client speaking HTTP and WebSocket (wsproto)
to the server's front (``Front.handle``) over an in-memory connection that, like a kernel's buffers, holds at most
:data:`WINDOW` bytes on their way: a reader that stops reading makes the server's writes wait, and its queue grows.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request

from server.front import Front
from server.runtime import MAX_VIEWERS_PER_SESSION
from server.transport.backlog_budget import SERVER_BACKLOG_BYTES
from server.transport.data_pace import DATA_BYTE_BURST
from server.transport.local_room import TEXT_BACKLOG_BYTES
from spec_tests import virtual_time
from spec_tests.security.room_clients import PATIENT
from spec_tests.security.room_clients import Client as RoomClient
from spec_tests.server.runner_fixtures import CounterService, serve, settings
from spec_tests.server.runner_fixtures import no_threads  # noqa: F401  (fixture)

WINDOW = 65536  # bytes a connection holds on their way in each direction (a kernel's socket buffers)
SESSIONS = 4  # running sessions, each with a controller sending large messages and 32 viewers
PAD = "a" * 12000  # a data message near the 12 KiB limit
FROZEN_ROOMS = 18  # sessions whose 32 viewers never read: 576 frozen sockets, more than the budget holds at FILL each
FILL = 14  # 12 KiB messages each of their controllers sends at once: ~115 KiB past what a frozen socket's window holds
TRICKLE = "a" * 1000  # ... then small ones at their pace (16 a second to 32 viewers): the budget stays full
HONEST_READ = 512 * 1024  # bytes a second the honest viewer reads (4 Mbit/s): twice what one participant may send


class Pipe:
    """One direction of a connection: at most ``window`` bytes on their way; a write waits for room."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.buffer = bytearray()
        self.writer_closed = self.reader_closed = False
        self.changed = trio.Event()

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(bytes(data))
        while True:
            if self.writer_closed:
                raise trio.ClosedResourceError
            if self.reader_closed:
                raise trio.BrokenResourceError
            if not view:
                break
            room = self.window - len(self.buffer)
            if room <= 0:
                await self.changed.wait()
                continue
            self.buffer += view[:room]
            view = view[room:]
            self.wake()
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while not self.buffer and not self.writer_closed and not self.reader_closed:
            await self.changed.wait()
        if self.reader_closed:
            raise trio.ClosedResourceError
        size = len(self.buffer) if max_bytes is None else max_bytes
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        self.wake()
        await trio.lowlevel.checkpoint()
        return data


class End(trio.abc.HalfCloseableStream):
    """One end of a connection of two pipes."""

    def __init__(self, outgoing: Pipe, incoming: Pipe) -> None:
        self.outgoing, self.incoming = outgoing, incoming

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.outgoing.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        self.outgoing.writer_closed = True
        self.outgoing.wake()
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.incoming.receive_some(max_bytes)

    async def aclose(self) -> None:
        for pipe in (self.outgoing, self.incoming):
            pipe.writer_closed = pipe is self.outgoing or pipe.writer_closed
            pipe.reader_closed = pipe is self.incoming or pipe.reader_closed
            pipe.wake()
        await trio.lowlevel.checkpoint()


class Client(RoomClient):
    """A room socket through the front; when it reads, a task notes every text message as it arrives."""

    def chats(self) -> list[int]:
        return [m["payload"]["n"] for m in self.texts if m.get("type") == "data" and m.get("topic") == "chat"]

    def refused(self) -> list[str]:
        return [m["reason"] for m in self.texts if m.get("type") == "refused"]


async def open_socket(
    front: Front, nursery: trio.Nursery, created: dict[str, Any], token: str, *, read: bool
) -> Client:
    """A socket that joined ``created``'s room with ``token``; it reads all that comes when ``read``, else nothing
    after the handshake (frozen)."""
    to_server, to_client = Pipe(WINDOW), Pipe(WINDOW)
    nursery.start_soon(front.handle, End(to_client, to_server))
    client = Client(End(to_server, to_client), WSConnection(ConnectionType.CLIENT))
    target = f"{created['websocket_path']}?token={token}"
    await client.stream.send_all(client.ws.send(Request(host="localhost", target=target)))
    while not any(isinstance(event, AcceptConnection) for event in client.ws.events()):
        client.ws.receive_data(await client.stream.receive_some(len(b"HTTP/1.1 101 ")))  # the handshake, no more
    if read:
        nursery.start_soon(client.read)
    return client


async def running_session(served: Any, front: Front, nursery: trio.Nursery, identity: str) -> tuple[dict, Client]:
    """A session created for ``identity``, and its controller's socket (reading all), once the session runs."""
    created = await served.create(identity)
    assert created["status"] != "queued", created
    ctl = await open_socket(front, nursery, created, created["token"], read=True)
    await ctl.wait_for(lambda c: any(m.get("topic") == "tf.status" and m["payload"].get("stage") == "running"
                                     for m in c.texts), within=30)
    return created, ctl


@attrs.define
class HonestAmongFrozen:
    """A running session whose viewer reads at an honest pace, beside sessions full of viewers that read nothing."""

    created: dict[str, Any]  # the honest viewer's session
    bursting: Client  # its controller
    honest: Client  # its viewer, reading at HONEST_READ
    controllers: list[Client]  # the frozen sessions' controllers
    frozen_rooms: list[str]
    frozen: list[Client]


async def honest_among_frozen(served: Any, front: Front, nursery: trio.Nursery, sessions: int) -> HonestAmongFrozen:
    """The honest session and viewer, then ``sessions`` more, each with as many frozen viewers as a session takes."""
    created, bursting = await running_session(served, front, nursery, "ctl-honest")
    honest = await open_socket(front, nursery, created, await served.viewer_token(created["session_id"], "v0"),
                               read=False)
    nursery.start_soon(honest.read, HONEST_READ)
    scene = HonestAmongFrozen(created, bursting, honest, [], [], [])
    for session in range(sessions):
        frozen_room, ctl = await running_session(served, front, nursery, f"ctl-{session}")
        scene.controllers.append(ctl)
        scene.frozen_rooms.append(frozen_room["room"])
        for index in range(MAX_VIEWERS_PER_SESSION):
            token = await served.viewer_token(frozen_room["session_id"], f"v{index}")
            scene.frozen.append(await open_socket(front, nursery, frozen_room, token, read=False))
    return scene


def queued_gauge(metrics: str) -> float:
    (line,) = [line for line in metrics.splitlines() if line.startswith("chunkline_room_queued_bytes ")]
    return float(line.split()[1])


async def flood(ctl: Client, sent: list[int], stop: trio.Event) -> None:
    """Large data messages as fast as the server reads them, each numbered, until ``stop``."""
    while not stop.is_set():
        await ctl.send_json({"topic": "chat", "payload": {"n": len(sent), "pad": PAD}})
        sent.append(len(sent))


@pytest.mark.usefixtures("no_threads")  # on the autojump clock a thread's real time would pass as virtual
async def test_frozen_viewers_are_sent_away_within_the_servers_budget_and_an_honest_one_keeps_receiving(
    autojump_clock: Any,
) -> None:
    """Four sessions, each a controller sending 12 KiB messages as fast as it may to 32 viewers of which all but one
    never read: 127 frozen sockets, whose queues each grow to 1 MiB before their own bound sends them away, would
    make the server hold 127 MiB. The queued text of all sockets together stays within the budget, read through
    the metrics gauge; the frozen go ``too_slow``, and the honest viewer receives every message of its room, in
    order, and is still there to receive the next."""
    service = CounterService(fps=2, frames_per_chunk=1, size=(8, 8))
    async with serve(settings(max_sessions_per_worker=SESSIONS, queue_size=1), service) as served:
        rooms = served.runtime.transport
        front = Front(rooms, "unused", max_message_bytes=16384, deadlines=PATIENT)
        async with trio.open_nursery() as nursery:
            controllers, frozen, names, honest = [], [], [], None
            for session in range(SESSIONS):
                created, ctl = await running_session(served, front, nursery, f"ctl-{session}")
                names.append(created["room"])
                controllers.append(ctl)
                for index in range(32):
                    token = await served.viewer_token(created["session_id"], f"v{index}")
                    if session == 0 and index == 0:
                        honest = await open_socket(front, nursery, created, token, read=True)
                    else:
                        frozen.append(await open_socket(front, nursery, created, token, read=False))
            assert honest is not None and len(frozen) == SESSIONS * 32 - 1
            await trio.testing.wait_all_tasks_blocked()
            assert TEXT_BACKLOG_BYTES * len(frozen) > 1.5 * SERVER_BACKLOG_BYTES  # what their own bounds allowed

            peak, gauges = 0, []
            sent: list[list[int]] = [[] for _ in controllers]
            stop = trio.Event()
            async with trio.open_nursery() as flooding:
                for ctl, numbers in zip(controllers, sent, strict=True):
                    flooding.start_soon(flood, ctl, numbers, stop)
                for step in range(600):
                    await virtual_time.elapse(0.01)
                    peak = max(peak, rooms.backlog.queued)
                    if step % 50 == 0:  # what an operator sees
                        gauges.append(queued_gauge(await served.metrics_text()))
                stop.set()  # each controller's last message goes whole
            assert max(gauges) <= SERVER_BACKLOG_BYTES, f"the gauge read {max(gauges) / 2**20:.1f} MiB"
            assert max(gauges) > SERVER_BACKLOG_BYTES / 2, f"the gauge read {max(gauges) / 2**20:.1f} MiB at most"
            assert peak <= SERVER_BACKLOG_BYTES, f"{peak / 2**20:.1f} MiB queued: past the server's budget"
            assert peak > SERVER_BACKLOG_BYTES * 0.9, f"only {peak / 2**20:.1f} MiB queued: the budget was not tested"
            assert rooms.backlog.sent_away > 0, "the budget sent nobody away"
            # each room holds its controller and its worker, and the first one the honest viewer too
            staying = sum(len(rooms.participants(room)) - 2 for room in names) - 1
            assert staying < len(frozen) // 2, f"{staying} of {len(frozen)} frozen viewers are still there"
            assert "v0" in rooms.participants(names[0]), "the honest viewer was sent away"
            assert honest.refused() == [], f"the honest viewer was refused: {honest.refused()}"
            await honest.wait_for(lambda c: len(c.chats()) == len(sent[0]), within=5)
            assert honest.chats() == sent[0], "the honest viewer missed messages"
            assert len(sent[0]) > 100
            await controllers[0].send_json({"topic": "chat", "payload": {"n": len(sent[0]), "pad": ""}})
            await honest.wait_for(lambda c: len(c.chats()) > len(sent[0]), within=5)
            nursery.cancel_scope.cancel()


async def send_numbered(ctl: Client, count: int) -> None:
    """``count`` large data messages, numbered from 0, as fast as the server reads them."""
    for n in range(count):
        await ctl.send_json({"topic": "chat", "payload": {"n": n, "pad": PAD}})


async def fill_then_trickle(ctl: Client, stop: trio.Event) -> None:
    """:data:`FILL` large messages at once, then small ones as fast as the server reads them, until ``stop``."""
    await send_numbered(ctl, FILL)
    while not stop.is_set():
        await ctl.send_json({"topic": "chat", "payload": {"pad": TRICKLE}})


@pytest.mark.usefixtures("no_threads")  # on the autojump clock a thread's real time would pass as virtual
async def test_a_viewer_that_reads_a_legal_burst_stays_while_frozen_viewers_that_hold_less_fill_the_budget(
    autojump_clock: Any,
) -> None:
    """576 frozen viewers in 18 busy sessions each hold ~115 KiB and a little more each moment, together more than
    the server's budget, which stays full. A controller sends its legal burst (256 KiB) to a viewer that reads
    512 KiB a second: for a moment that viewer holds ~190 KiB, more than any frozen one. Sending away the largest
    backlog first sent it away ``too_slow`` while the frozen stayed; now only frozen ones go (every socket sent away
    leaves a frozen one fewer; the honest viewer and the controllers stay), the honest viewer receives the whole
    burst, and the queued text stays within the budget."""
    service = CounterService(fps=2, frames_per_chunk=1, size=(8, 8))
    async with serve(settings(max_sessions_per_worker=FROZEN_ROOMS + 1, queue_size=1), service) as served:
        rooms = served.runtime.transport
        front = Front(rooms, "unused", max_message_bytes=16384, deadlines=PATIENT)
        async with trio.open_nursery() as nursery:
            scene = await honest_among_frozen(served, front, nursery, FROZEN_ROOMS)
            created, bursting, honest, busy = scene.created, scene.bursting, scene.honest, scene.controllers
            frozen_rooms, frozen = scene.frozen_rooms, len(scene.frozen)
            assert TEXT_BACKLOG_BYTES * frozen > 8 * SERVER_BACKLOG_BYTES  # what their own bounds allowed

            stop = trio.Event()
            for ctl in busy:
                nursery.start_soon(fill_then_trickle, ctl, stop)
            await virtual_time.elapse(0.5)  # FILL fits in each controller's burst, the trickle fills up the rest
            each = rooms.backlog.queued / len(rooms.backlog)
            assert rooms.backlog.sent_away > 0, "the frozen did not fill the budget"
            assert each < 0.75 * (DATA_BYTE_BURST - WINDOW), f"the frozen hold {each / 1024:.0f} KiB each"
            shed = rooms.backlog.sent_away

            burst = DATA_BYTE_BURST // len(PAD) + 1  # what the controller's fresh pace reads at once
            nursery.start_soon(send_numbered, bursting, burst)
            peak = 0
            for _ in range(100):
                await virtual_time.elapse(0.01)
                peak = max(peak, rooms.backlog.queued)
            stop.set()
            assert "v0" in rooms.participants(created["room"]), "the honest viewer was sent away"
            assert honest.refused() == [], f"the honest viewer was refused: {honest.refused()}"
            await honest.wait_for(lambda c: len(c.chats()) == burst, within=5)
            assert honest.chats() == list(range(burst)), "the honest viewer missed messages"
            assert peak <= SERVER_BACKLOG_BYTES, f"{peak / 2**20:.1f} MiB queued: past the server's budget"
            assert peak > SERVER_BACKLOG_BYTES * 0.95, f"only {peak / 2**20:.1f} MiB queued: the budget was not full"
            away = rooms.backlog.sent_away
            assert away > shed, "no frozen viewer was sent away while the burst was read"
            await virtual_time.elapse(1.5)  # each socket sent away leaves once its refusal's 1 s flush is over
            staying = sum(len(rooms.participants(room)) - 2 for room in frozen_rooms)  # less its controller, worker
            assert staying <= frozen - away, f"{staying} of {frozen} frozen stayed: {away} others were sent away"
            assert all(f"ctl-{session}" in rooms.participants(room) for session, room in enumerate(frozen_rooms))
            nursery.cancel_scope.cancel()


ATTACK_ROOMS = 3  # sessions of one attacker: 96 viewers that hold ~650 KiB each, ~61 MiB together
ATTACK_FILL = 60  # 12 KiB messages each attacker controller sends its viewers before they read a few


@pytest.mark.usefixtures("no_threads")  # on the autojump clock a thread's real time would pass as virtual
async def test_reading_a_few_messages_does_not_make_a_frozen_viewer_look_caught_up_to_an_honest_reader(
    autojump_clock: Any,
) -> None:
    """An attacker's 96 viewers stop reading and hold ~61 MiB between them. While an honest viewer (reading 512 KiB
    a second) holds its controller's legal burst, each of them reads a window's worth (the few messages it held when
    it fell behind), then the attacker's controllers send more, past the server's budget. The attacker's viewers
    have been behind since long before the burst and still hold ~600 KiB each, so they go ``too_slow``; the honest
    viewer stays and receives the whole burst. (When a socket's mark moved to the time the text it held at the mark
    was sent, those few messages made each attacker's ~600 KiB look caught up a moment ago, later than the honest
    viewer's mark, and the honest viewer was sent away first.)"""
    service = CounterService(fps=2, frames_per_chunk=1, size=(8, 8))
    async with serve(settings(max_sessions_per_worker=ATTACK_ROOMS + 1, queue_size=1), service) as served:
        rooms = served.runtime.transport
        front = Front(rooms, "unused", max_message_bytes=16384, deadlines=PATIENT)
        async with trio.open_nursery() as nursery:
            scene = await honest_among_frozen(served, front, nursery, ATTACK_ROOMS)
            created, bursting, honest = scene.created, scene.bursting, scene.honest
            attackers, viewers = scene.controllers, scene.frozen
            async with trio.open_nursery() as filling:
                for ctl in attackers:
                    filling.start_soon(send_numbered, ctl, ATTACK_FILL)
            await virtual_time.elapse(1.0)  # the attacker's paces are full again
            held = rooms.backlog.queued
            assert rooms.backlog.sent_away == 0 and 0.9 * SERVER_BACKLOG_BYTES < held < SERVER_BACKLOG_BYTES - 2**20

            burst = DATA_BYTE_BURST // len(PAD) + 1  # what the honest controller's fresh pace reads at once
            nursery.start_soon(send_numbered, bursting, burst)
            await virtual_time.elapse(0.05)  # the honest viewer holds most of its burst
            for viewer in viewers:  # a window's worth: the few messages queued when it fell behind are sent
                read = 0
                while read < WINDOW:
                    read += len(await viewer.stream.receive_some(WINDOW - read))
            async with trio.open_nursery() as overflowing:
                for ctl in attackers:
                    overflowing.start_soon(send_numbered, ctl, 12)  # ~13 MiB more to the attacker's 96 viewers
            for _ in range(10):  # the server reads them within the attacker's paces, while the honest viewer reads
                await virtual_time.elapse(0.01)
                if rooms.backlog.sent_away:
                    break
            assert rooms.backlog.sent_away > 0, "the attacker's viewers did not fill the budget"
            assert rooms.backlog.queued <= SERVER_BACKLOG_BYTES
            assert honest.refused() == [], f"the honest viewer was refused: {honest.refused()}"
            assert "v0" in rooms.participants(created["room"]), "the honest viewer was sent away"
            await honest.wait_for(lambda c: len(c.chats()) == burst, within=5)
            assert honest.chats() == list(range(burst)), "the honest viewer missed messages"
            nursery.cancel_scope.cancel()


@pytest.mark.usefixtures("no_threads")  # on the autojump clock a thread's real time would pass as virtual
async def test_a_participants_data_pace_is_kept_across_reconnects_until_it_is_full_again(autojump_clock: Any) -> None:
    """The rooms keep each participant's data pace as the front keeps its frame cap (one ``KeptBuckets``): while it
    is spent, leaving and coming back finds it spent (the reconnected controller's burst is what was left of it);
    once it is full again it is forgotten, so what is kept is bounded by the participants that left lately."""
    service = CounterService(fps=2, frames_per_chunk=1, size=(8, 8))
    async with serve(settings(), service) as served:
        rooms = served.runtime.transport
        front = Front(rooms, "unused", max_message_bytes=16384, deadlines=PATIENT)
        async with trio.open_nursery() as nursery:
            created = await served.create("ctl")
            viewers = [await open_socket(front, nursery, created, await served.viewer_token(created["session_id"],
                                                                                            f"v{index}"), read=True)
                       for index in range(8)]
            ctl = await open_socket(front, nursery, created, created["token"], read=True)
            await ctl.wait_for(lambda c: any(m.get("type") == "joined" for m in c.texts), within=5)
            assert len(rooms.paces) == 9  # one a participant with a socket
            sent: list[int] = []
            stop = trio.Event()
            nursery.start_soon(flood, ctl, sent, stop)
            await viewers[0].wait_for(lambda c: len(c.chats()) >= 20, within=5)  # its burst (256 KiB) is spent
            stop.set()
            await viewers[0].wait_for(lambda c: len(c.chats()) == len(sent), within=5)
            for client in [ctl, *viewers]:
                await client.stream.aclose()
            await virtual_time.elapse(0.01)
            assert not {"ctl", *(f"v{index}" for index in range(8))} & rooms.participants(created["room"])
            assert 1 <= len(rooms.paces) <= 9, "the paces that left were not kept while spent"
            again = await open_socket(front, nursery, created, created["token"], read=True)
            await again.wait_for(lambda c: any(m.get("type") == "joined" for m in c.texts), within=5)
            began, before = trio.current_time(), len(sent)
            stop = trio.Event()
            nursery.start_soon(flood, again, sent, stop)
            await virtual_time.elapse(0.05)
            stop.set()
            fresh = DATA_BYTE_BURST // len(PAD)  # the messages a fresh pace reads at once
            assert len(sent) - before < fresh, f"reconnecting bought the controller a fresh burst: {len(sent) - before}"
            await virtual_time.elapse(5.0 - (trio.current_time() - began))  # every pace is full again
            await again.stream.aclose()
            await virtual_time.elapse(5.0)
            viewer = await open_socket(front, nursery, created, await served.viewer_token(created["session_id"], "w"),
                                       read=True)
            await viewer.wait_for(lambda c: any(m.get("type") == "joined" for m in c.texts), within=5)
            assert len(rooms.paces) == 1, f"{len(rooms.paces)} paces kept: the full ones were not forgotten"
            nursery.cancel_scope.cancel()
