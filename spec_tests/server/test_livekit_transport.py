"""The LiveKit transport up to the SDK boundary (no LiveKit server exists here).

Covered: worker tokens as livekit-api sees them, connect failures bounded in
time (closed port, silent server) with no asyncio task left behind, refusing to
connect before ``run``, media capture through the SDK sources on the
trio-asyncio loop from a task that did not open it, and room callbacks turned
into port events.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import types
from typing import Any

import numpy as np
import pytest
import trio
import trio_asyncio
from livekit import api, rtc

from pipelines.contract import Audio
from server.tokens import TokenIssuer
from server.transport import (
    DataReceived,
    ParticipantJoined,
    ParticipantLeft,
    TransportError,
)
from server.transport.data_pace import LatestWins
from server.transport.livekit import (
    AUDIO_TRACK_NAME,
    EVENT_BACKLOG,
    VIDEO_TRACK_NAME,
    LiveKitTransport,
    _LiveKitConnection,
)
from server.transport.livekit_media import MediaPublisher, rgb_frame, video_options
from server.transport.livekit_sender import HELD_MOST, SENDER_WAIT, SendersToCome

KEY = "devkey"
SECRET = "0123456789abcdef0123456789abcdef-secret"


@pytest.fixture(autouse=True)
def quiet_livekit():
    """livekit logs each connect retry at WARNING (log records, not Python warnings)."""
    logger = logging.getLogger("livekit")
    before = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(before)


@pytest.fixture
def worker_token() -> str:
    return TokenIssuer(KEY, SECRET, 600).worker_token("stage", "worker-1")


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


async def start(nursery: trio.Nursery, url: str, **kwargs) -> tuple[LiveKitTransport, object]:
    transport = LiveKitTransport(url, **kwargs)
    loop = await nursery.start(transport.run)
    return transport, loop


async def other_asyncio_tasks(loop) -> set:
    async def probe() -> set:
        return asyncio.all_tasks() - {asyncio.current_task()}

    return await trio_asyncio.aio_as_trio(probe, loop=loop)()


# -- tokens ------------------------------------------------------------------------------------------


def test_worker_token_verifies_with_livekit_api(worker_token: str) -> None:
    claims = api.TokenVerifier(KEY, SECRET).verify(worker_token)
    assert claims.identity == "worker-1"
    assert claims.video.room_join is True and claims.video.room == "stage"
    assert claims.video.can_publish is True
    assert claims.video.can_publish_data is True
    assert claims.video.can_subscribe is False


# -- lifecycle and connect failures ------------------------------------------------------------------


def test_constructor_checks() -> None:
    transport = LiveKitTransport("ws://127.0.0.1:7880")
    assert transport.name == "livekit" and not transport.running
    assert (transport.connect_timeout, transport.disconnect_timeout) == (10.0, 5.0)
    with pytest.raises(ValueError):
        LiveKitTransport("")
    with pytest.raises(ValueError):
        LiveKitTransport("ws://x", connect_timeout=0)


async def test_connect_before_run_is_refused(worker_token: str) -> None:
    transport = LiveKitTransport("ws://127.0.0.1:7880")
    with pytest.raises(TransportError, match=r"not running.*nursery\.start\(transport\.run\)"):
        await transport.connect("stage", "worker-1", worker_token, timeout=1)


async def test_run_twice_is_refused(nursery: trio.Nursery) -> None:
    transport, _ = await start(nursery, "ws://127.0.0.1:7880")
    assert transport.running
    with pytest.raises(RuntimeError, match="already running"):
        await transport.run()


async def test_closed_port_fails_fast(nursery: trio.Nursery, worker_token: str) -> None:
    url = f"ws://127.0.0.1:{closed_port()}"
    transport, loop = await start(nursery, url)
    started = trio.current_time()
    with pytest.raises(TransportError) as info:
        await transport.connect("stage", "worker-1", worker_token, timeout=5)
    assert trio.current_time() - started < 5
    message = str(info.value)
    assert message.startswith(f"could not connect to LiveKit at {url} within 5 s: ")
    assert "refused" in message.lower()
    assert await other_asyncio_tasks(loop) == set()


async def test_silent_server_is_bounded_by_the_timeout(nursery: trio.Nursery, worker_token: str) -> None:
    async def never_answer(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, never_answer, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    transport, loop = await start(nursery, f"ws://127.0.0.1:{port}")
    timeout = 1
    started = trio.current_time()
    with pytest.raises(TransportError, match=r"within 1 s: no answer"):
        await transport.connect("stage", "worker-1", worker_token, timeout=timeout)
    # the failure guarded is an unbounded hang on a server that never answers: the timeout plus the hand-over of the
    # join (slow on a loaded host) tells "bounded by the timeout" from that, whatever the host's speed
    bounded_by = timeout + 1.0
    assert trio.current_time() - started < bounded_by
    # the SDK's join keeps trying on its own (cancelling it would not stop the native core); the
    # transport keeps it, and a task that leaves the room should it ever join
    names = sorted(task.get_coro().__qualname__ for task in await other_asyncio_tasks(loop))
    assert names == ["Room.connect", "_LiveKitConnection._leave_when_joined.<locals>.leave"], names
    assert transport.abandoned_joins == 1
    assert transport._connections == set()


async def test_connect_works_from_a_task_that_did_not_open_the_loop(nursery: trio.Nursery, worker_token: str) -> None:
    """The runner's task is a sibling of run(), not a child: the loop is passed explicitly."""
    transport, _ = await start(nursery, f"ws://127.0.0.1:{closed_port()}")
    errors: list[BaseException] = []

    async def runner() -> None:
        try:
            await transport.connect("stage", "worker-1", worker_token, timeout=3)
        except TransportError as exc:
            errors.append(exc)

    async with trio.open_nursery() as inner:
        inner.start_soon(runner)
    assert len(errors) == 1 and "could not connect" in str(errors[0])


# -- media through the SDK (no room) ------------------------------------------------------------------


async def test_media_publisher_captures_video_and_audio(nursery: trio.Nursery) -> None:
    _, loop = await start(nursery, "ws://127.0.0.1:7880")
    on_aio = lambda fn: trio_asyncio.aio_as_trio(fn, loop=loop)
    media = MediaPublisher(None)
    frames = np.zeros((3, 48, 64, 3), dtype=np.uint8)
    frames[..., 0] = 255
    for frame in frames:
        await on_aio(media.publish_frame)(frame, 16.0)
    assert media.frames_captured == 3 and media.video_size == (64, 48)
    assert media.video_track is not None and media.video_track.name == VIDEO_TRACK_NAME

    with pytest.raises(TransportError, match="frame size changed from 64x48 to 32x24"):
        await on_aio(media.publish_frame)(np.zeros((24, 32, 3), np.uint8), 16.0)
    with pytest.raises(TransportError, match="H x W x 3 uint8"):
        await on_aio(media.publish_frame)(np.zeros((48, 64, 4), np.uint8), 16.0)

    pcm = (np.sin(np.arange(960) / 10) * 8000).astype("<i2").tobytes()  # 20 ms at 48 kHz mono
    await on_aio(media.publish_audio)(Audio(pcm, 48000, 1))
    assert media.audio_frames_captured == 1
    assert media.audio_track is not None and media.audio_track.name == AUDIO_TRACK_NAME
    assert media.audio_source is not None and media.audio_source._loop is loop  # built on the trio-asyncio loop
    with pytest.raises(TransportError, match="audio format changed"):
        await on_aio(media.publish_audio)(Audio(pcm, 24000, 1))

    await on_aio(media.aclose)()
    await on_aio(media.aclose)()  # idempotent
    with pytest.raises(TransportError, match="closed"):
        media.capture_video(frames[0])
    assert await other_asyncio_tasks(loop) == set()


def test_rgb_frames_and_publish_options() -> None:
    frame = np.zeros((48, 64, 3), np.uint8)
    frame[..., 0] = 255  # pure red
    video = rgb_frame(frame)
    assert (video.width, video.height, video.type) == (64, 48, rtc.VideoBufferType.RGB24)
    # no full-frame copy on the trio thread: the SDK frame is the array's own memory
    assert np.shares_memory(np.frombuffer(video.data, np.uint8), frame)
    i420 = video.convert(rtc.VideoBufferType.I420)
    assert len(i420.data) == 64 * 48 * 3 // 2
    assert abs(i420.data[0] - 82) <= 2  # BT.601 luma of pure red: the SDK read it as RGB24

    options = video_options(24.0)
    assert options.source == rtc.TrackSource.SOURCE_CAMERA
    assert options.simulcast is False
    assert options.video_codec == rtc.VideoCodec.VP8
    assert options.video_encoding.max_framerate == 24.0
    assert options.video_encoding.max_bitrate == 8_000_000
    assert options.degradation_preference == rtc.DegradationPreference.MAINTAIN_RESOLUTION


# -- room callbacks become port events ----------------------------------------------------------------


class _FakeParticipant:
    def __init__(self, identity: str, state: int = rtc.ParticipantState.PARTICIPANT_STATE_JOINED, *,
                 may_send_data: bool = True) -> None:
        self.identity = identity
        self.state = state
        self.permissions = types.SimpleNamespace(can_publish_data=may_send_data)


async def test_a_participant_first_heard_of_already_active_has_joined(nursery: trio.Nursery) -> None:
    """The SDK reports ``participant_active`` for a change of state it sees: one first heard of already active may
    come with ``participant_connected`` alone, and was never counted in."""
    transport, loop = await start(nursery, "ws://127.0.0.1:7880")
    connection = _LiveKitConnection(transport, loop, "stage", "worker-1")

    async def emit_on_asyncio() -> None:
        room = rtc.Room(loop=loop)
        connection._attach(room)
        room.emit("participant_connected", _FakeParticipant("ctrl-1", rtc.ParticipantState.PARTICIPANT_STATE_ACTIVE))
        room.emit("participant_connected", _FakeParticipant("viewer-1"))  # joining: counted once active
        room.emit("participant_active", _FakeParticipant("viewer-1", rtc.ParticipantState.PARTICIPANT_STATE_ACTIVE))
        room.emit("disconnected", rtc.DisconnectReason.SERVER_SHUTDOWN)

    await trio_asyncio.aio_as_trio(emit_on_asyncio, loop=loop)()
    received = []
    with trio.fail_after(2), pytest.raises(TransportError):
        async for event in connection.events():
            received.append(event)
    assert received == [ParticipantJoined("ctrl-1"), ParticipantJoined("viewer-1")]
    await connection.disconnect()


async def test_room_callbacks_are_delivered_as_events(nursery: trio.Nursery) -> None:
    transport, loop = await start(nursery, "ws://127.0.0.1:7880")
    connection = _LiveKitConnection(transport, loop, "stage", "worker-1")

    async def emit_on_asyncio() -> None:
        room = rtc.Room(loop=loop)
        connection._attach(room)
        # LiveKit forwards a participant's data before the room hears of its join: the SDK names no sender then
        room.emit("data_received", rtc.DataPacket(data=b"early", kind=rtc.DataPacketKind.KIND_RELIABLE,
                                                  participant=None, topic="tf.control"))
        room.emit("participant_connected", _FakeParticipant("viewer-1", may_send_data=False))  # not its message
        room.emit("participant_connected", _FakeParticipant("ctrl-1"))  # not yet able to receive data
        room.emit("participant_active", _FakeParticipant("ctrl-1"))
        room.emit(
            "data_received",
            rtc.DataPacket(data=b'{"type":"x"}', kind=rtc.DataPacketKind.KIND_RELIABLE,
                           participant=_FakeParticipant("ctrl-1"), topic="tf.control"),
        )
        room.emit("participant_disconnected", _FakeParticipant("ctrl-1"))
        room.emit("disconnected", rtc.DisconnectReason.SERVER_SHUTDOWN)

    await trio_asyncio.aio_as_trio(emit_on_asyncio, loop=loop)()
    received = []
    with trio.fail_after(2), pytest.raises(TransportError, match="disconnected \\(SERVER_SHUTDOWN\\)"):
        async for event in connection.events():  # a lost room is an error, not a normal end
            received.append(event)
    assert received == [
        DataReceived("tf.control", b"early", "ctrl-1"),
        ParticipantJoined("ctrl-1"),
        DataReceived("tf.control", b'{"type":"x"}', "ctrl-1"),
        ParticipantLeft("ctrl-1"),
    ]
    assert connection.participants() == frozenset()
    with pytest.raises(TransportError, match="disconnected \\(SERVER_SHUTDOWN\\)"):
        await connection.send_data("tf.status", b"{}")
    await connection.disconnect()
    await connection.disconnect()  # idempotent
    with pytest.raises(TransportError, match="left the room"):
        await connection.publish_frame(np.zeros((4, 4, 3), np.uint8), 16.0)


async def test_a_data_flood_keeps_each_senders_newest_and_never_a_departure(nursery: trio.Nursery) -> None:
    """Past the unread backlog a sender's newest message waits in one slot (older ones are dropped); its leaving
    hands that one on first, and participant events are never held or dropped."""
    transport, loop = await start(nursery, "ws://127.0.0.1:7880")
    connection = _LiveKitConnection(transport, loop, "stage", "worker-1")
    flood = EVENT_BACKLOG + 50  # under the pace's burst: only the backlog holds it back

    async def emit_on_asyncio() -> None:
        room = rtc.Room(loop=loop)
        connection._attach(room)
        room.emit("participant_active", _FakeParticipant("ctrl-1"))
        for index in range(flood):
            room.emit("data_received", rtc.DataPacket(data=b'{"n": %d}' % index, kind=rtc.DataPacketKind.KIND_RELIABLE,
                                                      participant=_FakeParticipant("ctrl-1"), topic="tf.control"))
        room.emit("participant_disconnected", _FakeParticipant("ctrl-1"))
        room.emit("participant_active", _FakeParticipant("viewer-1"))

    await trio_asyncio.aio_as_trio(emit_on_asyncio, loop=loop)()
    events = connection.events()
    received = [await events.__anext__() for _ in range(1 + EVENT_BACKLOG + 1 + 2)]
    assert received[0] == ParticipantJoined("ctrl-1")
    data = received[1 : 2 + EVENT_BACKLOG]
    assert [event.payload for event in data] == [b'{"n": %d}' % n for n in [*range(EVENT_BACKLOG), flood - 1]]
    assert [event.replaced for event in data] == [0] * EVENT_BACKLOG + [flood - EVENT_BACKLOG - 1]
    assert received[-2:] == [ParticipantLeft("ctrl-1"), ParticipantJoined("viewer-1")]
    assert connection.dropped_events == flood - EVENT_BACKLOG - 1
    await events.aclose()
    await connection.disconnect()


class _ManualLoop:
    """An event loop's clock and timers, advanced by hand: ``run_until(t)`` fires what is due by ``t`` in order."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[list] = []  # [when, fn, args, cancelled]

    def time(self) -> float:
        return self.now

    def call_later(self, seconds: float, fn: Any, *args: Any) -> Any:
        timer = [self.now + seconds, fn, args, False]
        self.timers.append(timer)

        class Handle:
            def cancel(self) -> None:
                timer[3] = True

        return Handle()

    def run_until(self, when: float) -> None:
        while due := sorted((t for t in self.timers if not t[3] and t[0] <= when), key=lambda t: t[0]):
            timer = due[0]
            self.timers.remove(timer)
            self.now = timer[0]
            timer[1](*timer[2])
        self.now = when


def test_data_from_a_sender_the_room_has_not_heard_of_waits_for_it() -> None:
    """Such messages are the next data sender's the room hears of (a viewer may not send data), in order; past
    SENDER_WAIT, or past HELD_MOST waiting, they go on unnamed (as the LiveKit server's own API's sends do)."""
    loop = _ManualLoop()
    handed: list[DataReceived] = []
    waiting = SendersToCome(handed.append, loop.call_later)
    waiting.hold("tf.control", b"1")
    waiting.hold("tf.control", b"2")
    waiting.heard_of("viewer-1", may_send_data=False)
    assert handed == []
    waiting.heard_of("ctrl-1", may_send_data=True)
    assert handed == [DataReceived("tf.control", b"1", "ctrl-1"), DataReceived("tf.control", b"2", "ctrl-1")]
    loop.run_until(SENDER_WAIT + 1)  # its timer went with them
    handed.clear()
    waiting.hold("", b"srv")
    loop.run_until(loop.now + SENDER_WAIT - 0.5)
    assert handed == []
    loop.run_until(loop.now + 1)
    assert handed == [DataReceived("", b"srv", None)]
    handed.clear()
    for n in range(HELD_MOST + 1):
        waiting.hold("tf.control", b"%d" % n)
    assert handed == [DataReceived("tf.control", b"%d" % HELD_MOST, None)]
    waiting.close()  # the room went: what waited goes with it
    loop.run_until(loop.now + SENDER_WAIT + 1)
    assert len(handed) == 1


def test_a_senders_data_past_the_burst_goes_at_the_pace_and_its_newest_wins() -> None:
    """Nothing pushes back on a LiveKit sender, so its flood is taken at the local rooms' pace: the burst at once,
    then one message every 1/rate s, each the newest the sender had sent by then; each sender has its own pace."""
    loop = _ManualLoop()
    taken: list[tuple[float, str, int]] = []
    replaced: dict[int, int] = {}  # by message: how many of its sender's it replaced (its sender is told)

    def accept(event: DataReceived) -> bool:
        taken.append((loop.now, event.sender_identity, int(event.payload)))
        replaced[int(event.payload)] = event.replaced
        return True

    paced = LatestWins(accept, loop.time, loop.call_later, rate=100, burst=3)
    for n in range(10):  # at t=0: three go at once, the rest coalesce into the newest
        paced.offer(DataReceived("tf.control", b"%d" % n, "ctrl"))
    paced.offer(DataReceived("tf.control", b"0", "viewer"))  # another sender's pace is its own
    assert taken == [(0.0, "ctrl", 0), (0.0, "ctrl", 1), (0.0, "ctrl", 2), (0.0, "viewer", 0)]
    loop.run_until(0.005)
    paced.offer(DataReceived("tf.control", b"10", "ctrl"))  # newer than the one waiting: it takes its place
    loop.run_until(0.0101)
    assert taken[4:] == [(pytest.approx(0.01), "ctrl", 10)]
    assert paced.dropped == 7
    assert replaced == {0: 0, 1: 0, 2: 0, 10: 7}  # 3-9 waited and were replaced: the one handed on says so
    paced.offer(DataReceived("tf.control", b"11", "ctrl"))  # no token yet: waits for the next
    loop.run_until(0.05)
    assert taken[5:] == [(pytest.approx(0.02), "ctrl", 11)]
    # a sender that leaves: its waiting message comes back for the caller to hand on, its timer goes
    for n in (12, 13, 14, 15):  # the bucket refilled to its burst meanwhile
        paced.offer(DataReceived("tf.control", b"%d" % n, "ctrl"))
    assert taken[6:] == [(0.05, "ctrl", 12), (0.05, "ctrl", 13), (0.05, "ctrl", 14)]
    assert paced.forget("ctrl") == DataReceived("tf.control", b"15", "ctrl", replaced=0)
    loop.run_until(1.0)
    assert len(taken) == 9
    # a full backlog holds a message as the pace does: it waits, newest first, until accepted
    full = [True]
    paced = LatestWins(lambda event: not full[0] and accept(event), loop.time, loop.call_later, rate=100, burst=3)
    paced.offer(DataReceived("tf.control", b"20", "ctrl"))
    paced.offer(DataReceived("tf.control", b"21", "ctrl"))
    loop.run_until(1.05)
    full[0] = False
    loop.run_until(1.1)
    assert taken[9:] == [(pytest.approx(1.06), "ctrl", 21)] and paced.dropped == 1 and replaced[21] == 1
    paced.close()
    paced.offer(DataReceived("tf.control", b"22", "ctrl"))
    loop.run_until(2.0)
    assert len(taken) == 10


async def test_disconnect_of_an_unconnected_room_is_bounded(nursery: trio.Nursery) -> None:
    transport, loop = await start(nursery, "ws://127.0.0.1:7880", disconnect_timeout=1.0)
    connection = _LiveKitConnection(transport, loop, "stage", "worker-1")

    async def attach() -> None:
        connection._attach(rtc.Room(loop=loop))
        connection.media = MediaPublisher(None)
        await connection.media.publish_frame(np.zeros((8, 8, 3), np.uint8), 16.0)

    await trio_asyncio.aio_as_trio(attach, loop=loop)()
    with trio.fail_after(1.5):
        await connection.disconnect()
    assert connection.media.closed
    assert await other_asyncio_tasks(loop) == set()


async def test_stopping_run_leaves_open_rooms_first() -> None:
    transport = LiveKitTransport("ws://127.0.0.1:7880", disconnect_timeout=1.0)
    async with trio.open_nursery() as nursery:
        loop = await nursery.start(transport.run)
        connection = _LiveKitConnection(transport, loop, "stage", "worker-1")

        async def attach() -> None:
            connection._attach(rtc.Room(loop=loop))
            connection.media = MediaPublisher(None)
            await connection.media.publish_audio(Audio(bytes(1920), 48000, 1))

        await trio_asyncio.aio_as_trio(attach, loop=loop)()
        transport._connections.add(connection)  # as connect() does on success
        nursery.cancel_scope.cancel()
    assert not transport.running
    assert connection.media.closed and transport._connections == set()
    with pytest.raises(TransportError):
        await connection.send_data("tf.status", b"{}")
