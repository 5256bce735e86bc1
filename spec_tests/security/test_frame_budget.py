"""The room sockets' frame budget (``server.frame_budget``): one pool for the whole server, lent where it is wanted.

The budget was split in strict equal shares: with 256 sockets open each was read at 30 frames a second however
idle the others were, and a controller sending controls at 60 Hz waited in its own socket. Now what idle sockets
leave unused is lent to the sockets that want frames, each socket keeps its equal share as a floor while many
flood, all of them together are read no faster than the budget, and a participant's cap is kept across its
reconnects, so reconnecting over and over earns no fresh burst.

The app runs in-process on trio's autojump clock; each room socket is a client speaking HTTP and WebSocket
(wsproto) to the server's front (``Front.handle``, the code that serves the public port) over an in-memory stream,
so the budget's waits are virtual time and the figures are exact.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing
from wsproto.events import Ping

from server.frame_budget import (
    FRAME_BATCH, FRAME_BURST, FRAMES_PER_SECOND, JOIN_FRAMES, JOIN_WAIT_MOST, SERVER_FRAME_BURST,
    SERVER_FRAMES_PER_SECOND,
)
from server.front import Front
from spec_tests import virtual_time
from spec_tests.security.room_clients import PATIENT, Client, join
from spec_tests.server.runner_fixtures import CounterService, Served, serve, settings
from spec_tests.server.runner_fixtures import no_threads  # noqa: F401  (fixture)

IDLE = 256  # viewers' sockets open and silent (in queued sessions' rooms, 32 to a room: a session's most)
ROOMS = IDLE // 32
PROMPT = 0.002  # seconds (virtual): a frame the budget lets through at once is read within this


@attrs.define
class Rooms:
    """The app, the front serving its room sockets, and the nursery their connections run in."""

    served: Served
    front: Front
    nursery: trio.Nursery

    async def open(self, created: dict[str, Any], token: str, *, read: bool = True) -> Client:
        """A socket that joined ``created``'s room with ``token`` (its reader started when ``read``)."""
        return await join(self.front, self.nursery, created, token, read=read)

    async def idle_viewers(self) -> list[Client]:
        """IDLE silent viewer sockets, in queued sessions' rooms (no stream, nothing to read)."""
        viewers = []
        for room in range(ROOMS):
            queued = await self.served.create(f"queued-{room}")
            for index in range(32):
                token = await self.served.viewer_token(queued["session_id"], f"v{index}")
                viewers.append(await self.open(queued, token, read=False))
        await trio.testing.wait_all_tasks_blocked()
        assert self.front.frame_budget.sockets >= IDLE
        return viewers


@pytest.fixture
async def rooms() -> Any:
    service = CounterService(fps=2, frames_per_chunk=1, size=(8, 8))
    async with serve(settings(queue_size=ROOMS + 1), service) as served:
        front = Front(served.runtime.transport, "unused", max_message_bytes=16384, deadlines=PATIENT)
        async with trio.open_nursery() as nursery:
            yield Rooms(served, front, nursery), service
            front.close()


async def controller(rooms: Rooms, service: CounterService) -> tuple[Client, Any]:
    """The running session's controller socket, once its stream runs, and the session as the pipeline holds it."""
    created = await rooms.served.create("ctl")
    ctl = await rooms.open(created, created["token"])
    await ctl.wait_for(lambda c: any(m.get("topic") == "tf.status" and m["payload"].get("stage") == "running"
                                     for m in c.texts), within=30)
    (session,) = service.sessions.values()
    return ctl, session


async def controls_at(ctl: Client, session: Any, hertz: float, seconds: float) -> list[float]:
    """Send a control every 1 / ``hertz`` for ``seconds``; the (virtual) seconds each took to reach the pipeline."""
    late = []
    for index in range(int(hertz * seconds)):
        sent = trio.current_time()
        count = len(session.controls)
        keys = ["wasd"[index % 4]]
        await ctl.send_json({"topic": "tf.control", "payload": {"type": "control_state", "controls": keys}})
        with trio.move_on_after(1.0) as waited:
            await session.wait_for(lambda s: len(s.controls) > count)
        assert not waited.cancelled_caught, f"control {index} (of {hertz:g} a second) was not read within 1 s"
        late.append(trio.current_time() - sent)
        await virtual_time.elapse_until(sent + 1 / hertz)
    return late


@pytest.mark.usefixtures("no_threads")  # on the autojump clock a thread's real time would pass as virtual
async def test_a_controller_among_idle_sockets_is_read_at_60_hz_without_waiting(
    rooms: Any, autojump_clock: Any
) -> None:
    """With 256 viewers' sockets open and silent, a controller's 60 controls a second reach the pipeline as they
    are sent, for three seconds (in strict equal shares its socket was read at 31 frames a second, and its
    controls fell further behind with each one)."""
    room_sockets, service = rooms
    ctl, session = await controller(room_sockets, service)
    await room_sockets.idle_viewers()
    late = await controls_at(ctl, session, 60, 3.0)
    assert max(late) <= PROMPT, f"controls waited up to {max(late):.3f} s (the {late.index(max(late))}th)"


@pytest.mark.usefixtures("no_threads")  # on the autojump clock a thread's real time would pass as virtual
async def test_flooders_are_read_at_the_servers_budget_and_an_honest_socket_at_its_share(
    rooms: Any, autojump_clock: Any
) -> None:
    """16 sockets flood pings among 256 idle ones and a controller: together they are read at the server's budget
    (lent what the idle sockets leave), never faster than its rate past its burst; each flooder at least its
    equal share; and the controller, sending within its equal share, has every control read as it is sent."""
    room_sockets, service = rooms
    ctl, session = await controller(room_sockets, service)
    await room_sockets.idle_viewers()
    created = await room_sockets.served.create("flood")  # queued: its room has no stream
    flooders = [await room_sockets.open(created, await room_sockets.served.viewer_token(created["session_id"], f"f{i}"))
                for i in range(16)]
    sockets = room_sockets.front.frame_budget.sockets
    share = min(FRAMES_PER_SECOND, SERVER_FRAMES_PER_SECOND / sockets)
    share_burst = min(FRAME_BATCH, SERVER_FRAME_BURST // sockets)
    seconds = 2.0
    async with trio.open_nursery() as nursery:
        started = trio.current_time()
        for flooder in flooders:
            nursery.start_soon(flooder.send, flooder.ws.send(Ping(b"f")) * 3 * FRAMES_PER_SECOND)
        honest = trio.Event()

        async def honest_controls() -> None:
            late = await controls_at(ctl, session, share * 0.85, seconds)
            assert max(late) <= PROMPT, f"controls waited up to {max(late):.3f} s"
            honest.set()

        nursery.start_soon(honest_controls)
        await virtual_time.elapse_until(started + seconds)
        read = [flooder.pongs for flooder in flooders]
        await honest.wait()
        nursery.cancel_scope.cancel()
    # the pool's burst and rate, and the flooders' guaranteed shares' bursts, a step over at most each
    most = SERVER_FRAME_BURST + SERVER_FRAMES_PER_SECOND * seconds + len(flooders) * (share_burst + FRAME_BATCH)
    assert sum(read) <= most, f"{sum(read)} frames read in {seconds} s: over the budget ({most})"
    assert sum(read) >= SERVER_FRAMES_PER_SECOND * seconds, f"only {sum(read)} read in {seconds} s: not lent"
    assert min(read) >= share * seconds, f"a flooder read {min(read)} in {seconds} s, under its share {share:.1f}/s"


@pytest.mark.usefixtures("no_threads")  # on the autojump clock a thread's real time would pass as virtual
async def test_reconnecting_over_and_over_earns_no_fresh_burst(rooms: Any, autojump_clock: Any) -> None:
    """A viewer that sends a burst of pings on each of ten sockets, one after another, is read as if it had kept
    one socket: past its one FRAME_BURST at FRAMES_PER_SECOND at most (each joining costs it JOIN_FRAMES more).
    Each socket had its own burst: all ten were read at once."""
    room_sockets, _ = rooms
    created = await room_sockets.served.create("ctl")
    token = await room_sockets.served.viewer_token(created["session_id"], "churn")
    started = trio.current_time()
    read = 0
    for _ in range(10):
        viewer = await room_sockets.open(created, token)
        await viewer.wait_for(lambda c: any(m.get("type") == "joined" for m in c.texts), within=5)
        await viewer.send(viewer.ws.send(Ping(b"c")) * FRAME_BURST)
        await virtual_time.elapse(0.01)
        read += viewer.pongs
        await viewer.stream.aclose()
        with trio.fail_after(5):
            while "churn" in room_sockets.served.runtime.transport.participants(created["room"]):
                await virtual_time.elapse(0.01)  # the server reads what was sent before it sees the close
    elapsed = trio.current_time() - started
    most = FRAME_BURST + FRAMES_PER_SECOND * elapsed + FRAME_BATCH  # one burst, then the rate (a step over)
    assert read <= most, f"{read} pings read on 10 sockets in {elapsed:.2f} s: each socket had a fresh burst"


def answered(client: Client) -> bool:
    return any(m.get("type") in ("joined", "refused") for m in client.texts)


@pytest.mark.usefixtures("no_threads")  # on the autojump clock a thread's real time would pass as virtual
async def test_sockets_opened_together_wait_no_longer_than_join_wait_most(rooms: Any, autojump_clock: Any) -> None:
    """A viewer past its burst of joins opens 100 sockets at once (none in the room yet): each is answered -- joined,
    or refused ``identity_in_use`` or ``joining_too_often`` -- within JOIN_WAIT_MOST, and the viewer's next socket
    joins within it too. Each was charged and waited: the last waited 9 s unanswered (past the pong deadline it
    would have been sent away, having read nothing), and the cap's debt, and so the next join's wait, had no bound."""
    room_sockets, _ = rooms
    created = await room_sockets.served.create("ctl")
    token = await room_sockets.served.viewer_token(created["session_id"], "storm")
    participants = room_sockets.served.runtime.transport.participants

    async def gone() -> None:
        with trio.fail_after(5):
            while "storm" in participants(created["room"]):
                await virtual_time.elapse(0.01)

    for _ in range(FRAME_BURST // JOIN_FRAMES + 1):  # its burst of joins spent: its next socket waits to join
        viewer = await room_sockets.open(created, token)
        await viewer.wait_for(answered, within=5)
        await viewer.stream.aclose()
        await gone()
    storm = [await room_sockets.open(created, token) for _ in range(100)]
    opened = trio.current_time()
    with trio.move_on_after(30):
        for viewer in storm:
            await viewer.wait_for(answered, within=30)
    slowest = trio.current_time() - opened
    assert slowest <= JOIN_WAIT_MOST + PROMPT, f"a socket waited {slowest:.2f} s for an answer"
    reasons = {m.get("reason") for viewer in storm for m in viewer.texts if m.get("type") == "refused"}
    assert reasons <= {"identity_in_use", "joining_too_often"}, reasons
    # none was in the room at the door: the room refused the identity once one had joined, and such a refusal closes
    # with the door's code, 4401 (it closed with 1000, a visit that ended)
    for viewer in storm:
        refusals = [m["reason"] for m in viewer.texts if m.get("type") == "refused"]
        if refusals:
            await viewer.wait_for(lambda c: c.close_code is not None, within=5)
            assert viewer.close_code == {"identity_in_use": 4401, "joining_too_often": 4429}[refusals[0]], refusals
    assert "identity_in_use" in reasons
    for viewer in storm:
        await viewer.stream.aclose()
    await gone()
    started = trio.current_time()
    viewer = await room_sockets.open(created, token)
    await viewer.wait_for(lambda c: any(m.get("type") == "joined" for m in c.texts), within=30)
    waited = trio.current_time() - started
    assert waited <= JOIN_WAIT_MOST + PROMPT, f"the next join waited {waited:.2f} s"
