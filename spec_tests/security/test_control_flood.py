"""One controller floods its room with 1,500 ``control_state`` messages as fast as it can.

"Bounded" here means, concretely:

- the flood is read at the participant's pace, not the sender's: past a burst of 500, 500 messages a second
  (``DataPace``), so the last of them reaches the pipeline no sooner than the pace allows; one controller
  writing 23,000 a second took a whole core, and another session's stream fell from 16 to about 1 fps;

- the server stays responsive: ``GET /v1/service/health`` is answered in under
  :data:`HEALTH_WITHIN` seconds (wall clock) every time it is asked while the flood runs;
- queues do not grow with the flood: the worker's event channel of the local transport holds at most
  its fixed backlog (``EVENT_BACKLOG`` = 256; beyond it events are dropped, never queued), and the
  controller's outgoing text queue stays under :data:`TEXT_BACKLOG_BOUND` messages (valid controls
  are not answered, so nothing should pile up there);
- no task is left behind: once the flood settles, ``trio.lowlevel.current_statistics().tasks_living``
  is back to its value before the flood;
- latest-wins for ``control_state``: each message is the full set of held keys, so intermediate
  messages may be dropped, but once the flood settles the keys the pipeline holds are the keys of the
  *last* message sent.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from server.transport import data_pace, local, local_room
from spec_tests.server.runner_fixtures import CounterService, Peer, join, serve, settings
from spec_tests.server.runner_fixtures import no_threads  # noqa: F401  (fixture)

FLOOD = 1_500
HEALTH_WITHIN = 5.0  # seconds, wall clock: a starved event loop, not a slow one (latency is bench.server's job)
TEXT_BACKLOG_BOUND = 64
# seconds, wall clock: the bound on each wait for the flood to settle. The flood runs in real time (its health
# latency is a wall-clock promise), so the bound is real seconds; the waits themselves are woken by events
SETTLE_WITHIN = 10.0
KEY_SETS = [["w"], ["a"], ["s"], ["d"], ["w", "a"], ["s", "d"], [], ["j"], ["l"]]
LAST = ["i", "k"]  # sent once, last: the state the pipeline must end with


class SlowControlService(CounterService):
    """Applies a control in :data:`CONTROL_COST` seconds (a model that takes time to take a control in):
    the runner falls behind the flood and the transport's event channel fills up."""

    async def push_control(self, session_id: str, control: Any) -> None:
        await trio.sleep(CONTROL_COST)  # bench-cost: the model's per-control work (real time, like the flood)
        await super().push_control(session_id, control)


CONTROL_COST = 0.0005


class _TaskExits(trio.abc.Instrument):
    """trio's own hook on every task that ends: what :func:`tasks_living_at_most` waits on."""

    def __init__(self) -> None:
        self.exited = trio.Event()

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self.exited.set()


async def tasks_living_at_most(count: int) -> None:
    """Wait until no more than ``count`` tasks live, woken by each task that ends (no polling);
    the caller bounds the wait."""
    exits = _TaskExits()
    trio.lowlevel.add_instrument(exits)
    try:
        while True:
            await wait_all_tasks_blocked()
            exited = exits.exited = trio.Event()  # fresh before the count: an exit after it wakes us
            if trio.lowlevel.current_statistics().tasks_living <= count:
                return
            await exited.wait()
    finally:
        trio.lowlevel.remove_instrument(exits)


async def test_a_control_flood_is_bounded_and_latest_wins() -> None:
    """The runner keeps up with the flood (an instant ``push_control``)."""
    await flood_and_check(CounterService(fps=20, frames_per_chunk=2, size=(8, 8)))


async def test_a_flood_faster_than_the_pipeline_is_bounded_and_latest_wins() -> None:
    """The runner cannot keep up: intermediate messages are dropped, the last one must not be."""
    await flood_and_check(SlowControlService(fps=20, frames_per_chunk=2, size=(8, 8)))


async def flood_and_check(service: CounterService) -> None:
    async with serve(settings(), service) as served:
        created = await served.create("ctl")
        async with join(served, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "the session to run", timeout=20)
            (session,) = service.sessions.values()
            transport = served.runtime.transport
            room = transport._rooms[created["room"]]
            worker, subscriber = room.worker, room.subscribers["ctl"]
            assert worker is not None
            await wait_all_tasks_blocked()
            baseline = trio.lowlevel.current_statistics().tasks_living

            probes: list[float] = []
            peaks = {"events": 0, "texts": 0}
            flooding = trio.Event()
            done = trio.Event()

            async def flood() -> None:
                flooding.set()
                for n in range(FLOOD - 1):
                    await ctl.control({"type": "control_state", "controls": KEY_SETS[n % len(KEY_SETS)]})
                await ctl.control({"type": "control_state", "controls": LAST})
                done.set()

            async def probe() -> None:
                await flooding.wait()
                while not done.is_set():
                    started = time.monotonic()
                    status, body = await served.json("get", "/v1/service/health")
                    probes.append(time.monotonic() - started)
                    assert status == 200 and body["ready"] is True, body
                    peaks["events"] = max(peaks["events"], worker.queued_data)
                    peaks["texts"] = max(peaks["texts"], len(subscriber.texts))
                    await trio.sleep(0.005)  # bench-cost: probe spacing of the load measurement

            started = time.monotonic()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(probe)
                nursery.start_soon(flood)
            flood_seconds = time.monotonic() - started

            # the flood settles: the pipeline ends with the last message's keys (woken by each control the
            # service takes in; past the bound the assertions below say what was seen)
            with trio.move_on_after(SETTLE_WITHIN):
                await session.wait_for(lambda taken: taken.held == set(LAST))
            settled_after = time.monotonic() - started
            applied = [c for c in session.controls]
            report = (f"{len(applied)} of {FLOOD} controls reached the pipeline in {flood_seconds:.2f} s; "
                      f"last applied {sorted(applied[-1].keys) if applied else None}; probes {len(probes)}, "
                      f"slowest {max(probes, default=0):.3f} s; peaks {peaks}")
            assert probes, f"no health probe ran during the flood ({report})"
            assert max(probes) < HEALTH_WITHIN, report
            assert peaks["events"] <= local.EVENT_BACKLOG, report
            assert peaks["texts"] <= TEXT_BACKLOG_BOUND, report
            assert not ctl.status("control_rejected"), report
            assert session.held == set(LAST), f"latest-wins broken: the pipeline holds {sorted(session.held)}; {report}"
            paced = (FLOOD - data_pace.DATA_BURST) / data_pace.DATA_MESSAGES_PER_SECOND
            assert settled_after >= paced, f"read faster than its pace ({settled_after:.2f} s < {paced:.2f} s); {report}"
            assert (await served.get(created["session_id"]))["status"] == "running"

            # no task is left behind by the flood
            with trio.move_on_after(SETTLE_WITHIN):
                await tasks_living_at_most(baseline)
            living = trio.lowlevel.current_statistics().tasks_living
            assert living <= baseline, f"{living} tasks living after the flood, {baseline} before ({report})"


STALLED_VIEWER_BOUND = local_room.TEXT_BACKLOG  # messages queued for one subscriber that does not read


def seen_in_room(peer: Peer) -> set[str]:
    """Who the room told ``peer`` of: the participants already there when it joined, and those who joined after."""
    seen = set()
    for message in peer.texts():
        if message["type"] == "joined":
            seen.update(message["participants"])
        elif message["type"] == "participant_joined":
            seen.add(message["identity"])
    return seen


async def test_a_flood_with_a_stalled_viewer_keeps_the_viewer_queue_bounded() -> None:
    """A viewer that stops reading must not make the server queue the whole flood for it.

    Every valid control is also broadcast to the room's other participants as a data message, and data
    messages are never dropped for a slow subscriber (server/transport/local.py): its text queue is an
    unbounded deque, so a controller flooding a room with a stalled viewer grows server memory with the
    flood (up to ``max_data_message_bytes`` per message).
    """
    service = CounterService(fps=20, frames_per_chunk=2, size=(8, 8))
    async with serve(settings(), service) as served:
        created = await served.create("ctl")
        token = await served.viewer_token(created["session_id"], "stalled")
        async with join(served, created["room"], created["token"]) as ctl, \
                served.client.websocket(f"/v1/rooms/{created['room']}/ws?token={token}"):
            await ctl.wait_for(lambda p: "running" in p.stages(), "the session to run", timeout=20)
            # the room tells the controller of the viewer once it holds the viewer's socket
            await ctl.wait_for(lambda p: "stalled" in seen_in_room(p), "the stalled viewer to join", timeout=SETTLE_WITHIN)
            viewer = served.runtime.transport._rooms[created["room"]].subscribers["stalled"]
            peak = 0
            for n in range(FLOOD):
                await ctl.control({"type": "control_state", "controls": KEY_SETS[n % len(KEY_SETS)]})
                peak = max(peak, len(viewer.texts))
            status, _ = await served.json("get", "/v1/service/health")
            assert status == 200
            assert peak <= STALLED_VIEWER_BOUND, (
                f"{peak} messages queued for a viewer that does not read ({FLOOD} sent by the controller)"
            )


FAN_OUT_VIEWERS = 10
CHATTER = 200  # messages, each written to FAN_OUT_VIEWERS viewers: 2,000 writes, past the burst of 500


@pytest.mark.usefixtures("no_threads")  # on the autojump clock a thread's real time would pass as virtual
async def test_a_message_counts_once_for_each_participant_the_room_writes_it_to(autojump_clock: Any) -> None:
    """A controller's message is written to every other participant: with FAN_OUT_VIEWERS reading, CHATTER messages
    are FAN_OUT_VIEWERS times as many writes, and the room takes them no faster than DATA_MESSAGES_PER_SECOND writes
    past the burst (counted by messages read, one controller made the room write its 500 a second to each of up to
    63 others). Virtual time: the worker's answer to the last message (chat is no control) comes no sooner."""
    service = CounterService(fps=2, frames_per_chunk=1, size=(8, 8))
    async with serve(settings(), service) as served:
        created = await served.create("ctl")
        async with contextlib.AsyncExitStack() as stack:
            ctl = await stack.enter_async_context(join(served, created["room"], created["token"]))
            await ctl.wait_for(lambda p: "running" in p.stages(), "the session to run")
            for index in range(FAN_OUT_VIEWERS):
                token = await served.viewer_token(created["session_id"], f"v{index}")
                viewer = await stack.enter_async_context(join(served, created["room"], token))
                await viewer.wait_for(lambda p: any(m["type"] == "joined" for m in p.texts()), "joined")
            started = trio.current_time()
            for _ in range(CHATTER):
                await ctl.send("chat", {"n": 1})
            await ctl.wait_for(lambda p: len(p.status("control_rejected")) == CHATTER, "the answers", timeout=600)
            taken = trio.current_time() - started
    writes = CHATTER * FAN_OUT_VIEWERS
    # past the burst, every write but the last message's own is paid for before that message is read
    paced = (writes - FAN_OUT_VIEWERS - data_pace.DATA_BURST) / data_pace.DATA_MESSAGES_PER_SECOND
    assert taken >= paced, f"{writes} writes taken in {taken:.2f} s (virtual), under their pace ({paced:.2f} s)"


REFUSED = 40  # messages the room refuses, each REFUSED_CHARS long: 2.4 M characters read, past the byte burst
REFUSED_CHARS = 60_000


@pytest.mark.usefixtures("no_threads")  # on the autojump clock a thread's real time would pass as virtual
async def test_refused_messages_are_read_no_faster_than_their_size_allows(autojump_clock: Any) -> None:
    """Messages the room refuses (here: text that is no JSON envelope, each under the size bound) cost the server
    their reading: they are paid for by their size at the pace a sender's accepted text is, DATA_BYTES_PER_SECOND
    past DATA_BYTE_BURST, so the last refusal comes no sooner than that allows (by message count alone, 40 such
    messages were read at once: six senders of 1 MiB ones kept a quarter of a core busy). Virtual time."""
    service = CounterService(fps=2, frames_per_chunk=1, size=(8, 8))
    async with serve(settings(max_data_message_bytes=65_536), service) as served:
        created = await served.create("ctl")
        async with join(served, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "the session to run")
            started = trio.current_time()
            for _ in range(REFUSED):
                await ctl.ws.send("x" * REFUSED_CHARS)
            refusals = await ctl.wait_for(
                lambda p: len(found := [m for m in p.texts() if m.get("type") == "refused"]) >= REFUSED and found,
                "the refusals", timeout=600,
            )
            taken = trio.current_time() - started
    assert {m["reason"] for m in refusals} == {"malformed_envelope"}
    # every refused message but the last is paid for before the next is read
    paced = ((REFUSED - 1) * REFUSED_CHARS - data_pace.DATA_BYTE_BURST) / data_pace.DATA_BYTES_PER_SECOND
    assert taken >= paced, f"{REFUSED} refused messages read in {taken:.2f} s (virtual), under their pace ({paced:.2f} s)"
