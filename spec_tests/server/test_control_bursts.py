"""A controller's legal burst reaches its worker whole, however slowly the worker takes it; none is dropped unsaid.

The room read a controller's socket at its pace (a burst of 500), while its runner awaited each control's round trip
to a worker process (or an agent's socket); past 256 untaken data events the room dropped the oldest without a word,
so a burst of 500 to a worker process lost about 240 controls, a ``stop`` or a ``prompt`` among them. Now, while
256 wait, the room stops reading the sender's socket (its messages wait there) until the worker takes one; a message
that cannot be taken within ``WORKER_TAKE_TIMEOUT`` is refused ``worker_stalled``, and those a worker that left never
took are told ``session_ended``. Through the app's room sockets with an in-test service that takes no control until
the test lets it (the worker process's round trip, made as long as the test likes), and on the hub
(:class:`~server.transport.local.LocalRooms`) for a worker agent whose socket is not read.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from pipelines.contract import Control, ControlType
from server.transport.local import LocalRooms
from server.transport.worker_inbox import EVENT_BACKLOG, EVENT_BACKLOG_BYTES, WORKER_TAKE_TIMEOUT

from .runner_fixtures import CounterService, join, make_issuer, serve, settings

BURST = 500  # the documented burst (DATA_BURST): read at once, no pace in between
SPECIAL_AT = 100  # the 101st message is the prompt or the stop
WITHIN = 20.0  # seconds each wait below may take at most (woken by events; real time, the runner's clocks run)


class GatedService(CounterService):
    """Takes no control until ``gate`` is set: meanwhile the room's events pile up for the runner, as they do while a
    worker process answers a control's round trip."""

    def __init__(self) -> None:
        super().__init__(fps=10, frames_per_chunk=2, size=(8, 8))
        self.gate = trio.Event()
        self.held = trio.Event()  # a control is waiting at the gate

    async def push_control(self, session_id: str, control: Control) -> None:
        self.held.set()
        await self.gate.wait()
        await super().push_control(session_id, control)


def burst_message(n: int, special: dict[str, Any]) -> dict[str, Any]:
    if n == SPECIAL_AT:
        return special
    return {"type": "control", "control": "w", "event": "press" if n % 2 == 0 else "release"}


@pytest.mark.parametrize("special", [{"type": "prompt", "prompt": "night"}, {"type": "stop"}], ids=["prompt", "stop"])
async def test_a_burst_of_legal_controls_to_a_worker_that_takes_them_slowly_loses_none(special: dict[str, Any]) -> None:
    service = GatedService()
    async with serve(settings(), service) as served:
        created = await served.create("ctl")
        async with join(served, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "the session to run", timeout=WITHIN)
            (session,) = service.sessions.values()
            sent_all = trio.Event()

            async def send_burst() -> None:  # it waits in the socket while the room does not read it
                try:
                    for n in range(BURST):
                        await ctl.control(burst_message(n, special))
                except trio.BrokenResourceError:  # the server closed the socket: only a stopped session's end does
                    assert special["type"] == "stop", "the controller's socket closed while its session ran"
                sent_all.set()

            async with trio.open_nursery() as sending:
                sending.start_soon(send_burst)
                with trio.fail_after(WITHIN):
                    await service.held.wait()
                await wait_all_tasks_blocked()  # the room read what it would: up to the worker's backlog
                service.gate.set()
                with trio.fail_after(WITHIN):
                    await sent_all.wait()
                    if special["type"] == "prompt":
                        await session.wait_for(lambda taken: len(taken.controls) == BURST)
                    else:  # the stop ends the session: the controls before it reached the pipeline, then its stop
                        await ctl.wait_for(lambda p: p.status("done"), "the session's end", timeout=WITHIN)
            record = await served.get(created["session_id"])
            refused = [m for m in ctl.texts() if m["type"] == "refused"]
            if special["type"] == "prompt":
                assert [c.type for c in session.controls] == [
                    ControlType.PROMPT if n == SPECIAL_AT else ControlType.CONTROL for n in range(BURST)]
                assert session.controls[SPECIAL_AT].prompt == "night"
                assert record["status"] == "running" and not refused, (record, refused)
                assert not ctl.status("control_rejected")
            else:
                assert record["drain_cause"] == "stop", record
                assert [c.type for c in session.controls[:SPECIAL_AT]] == [ControlType.CONTROL] * SPECIAL_AT
                # what came after the stop was not taken, and the controller is told so rather than nothing
                assert {m["reason"] for m in refused} <= {"session_ended"}, refused
                # and counted: at least as many as the controller had been told when the texts were read (the room
                # reads and refuses what is left in the socket until it closes)
                told = sum(int(m["detail"].split(" ", 1)[0]) if m["detail"][0].isdigit() else 1 for m in refused)
                counted = re.search(r'chunkline_room_refusals_total\{reason="session_ended"\} (\S+)',
                                    await served.metrics_text())
                assert (float(counted[1]) if counted else 0.0) >= told, (counted, told)


class Hub:
    """Local rooms with one room holding a worker agent (its socket given to :meth:`start`) and a controller whose
    socket holds up to ``burst`` unread messages (``sent``); what the controller is sent goes to ``inbox``, and
    ``told`` is set at its first refusal."""

    def __init__(self, burst: int, **rooms_settings: Any) -> None:
        self.issuer = make_issuer()
        self.rooms = LocalRooms(self.issuer, **rooms_settings)
        self.sent_in, self.sent = trio.open_memory_channel[str](burst)
        self.inbox: list[dict[str, Any]] = []
        self.told = trio.Event()

    async def start(self, nursery: trio.Nursery, agent_socket: Any, room: str = "room-1") -> None:
        rooms, issuer = self.rooms, self.issuer
        rooms.expect_worker(room, "chunkline-agent")

        async def agent_says_nothing() -> str:
            await trio.Event().wait()  # never set: the agent sends nothing
            raise AssertionError("unreachable")

        async def to_controller(message: str | bytes) -> None:
            self.inbox.append(received := json.loads(message))
            if received["type"] == "refused":
                self.told.set()

        worker = rooms.admit_client(room, issuer.worker_token(room, "chunkline-agent"))
        nursery.start_soon(rooms.serve_worker, room, worker, agent_socket, agent_says_nothing)
        await wait_all_tasks_blocked()
        ctl = rooms.admit_client(room, issuer.controller_token(room, "ctl"))
        nursery.start_soon(rooms.serve_client, room, ctl, to_controller, self.sent.receive)
        await wait_all_tasks_blocked()

    def unread(self) -> int:
        """The controller's messages the room has not read yet (they wait in its socket)."""
        return self.sent.statistics().current_buffer_used

    def refusals(self) -> list[str]:
        return [m["reason"] for m in self.inbox if m["type"] == "refused"]


class GatedAgent:
    """A worker agent's socket that reads nothing until ``gate`` is set (its runner awaits a control), then records
    each data message's ``n``; ``all_got`` once ``expected`` came."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.gate, self.all_got = trio.Event(), trio.Event()
        self.got: list[int] = []

    async def socket(self, message: str | bytes) -> None:
        await self.gate.wait()
        if (received := json.loads(message))["type"] == "data":
            self.got.append(received["payload"]["n"])
            if len(self.got) == self.expected:
                self.all_got.set()


def control_text(n: int) -> str:
    return json.dumps({"topic": "tf.control", "payload": {"type": "control", "control": "w", "n": n}})


async def test_a_worker_agent_that_reads_slowly_gets_every_message_of_a_burst() -> None:
    """The hub's side for an agent: its socket is not written while the agent reads nothing; the burst waits (in the
    sender's socket, past the agent's backlog) and then reaches the agent whole, in order."""
    hub, agent = Hub(BURST), GatedAgent(BURST)
    async with trio.open_nursery() as nursery:
        await hub.start(nursery, agent.socket)
        for n in range(BURST):
            hub.sent_in.send_nowait(control_text(n))
        await wait_all_tasks_blocked()
        # the hub read what the agent's backlog holds, and the rest waits in the sender's socket
        assert hub.unread() > 0, "the whole burst was read although the agent took none"
        agent.gate.set()
        with trio.fail_after(WITHIN):
            await agent.all_got.wait()
        nursery.cancel_scope.cancel()
    assert agent.got == list(range(BURST))
    assert not hub.refusals(), hub.inbox


async def test_a_message_the_worker_cannot_take_within_the_bound_is_refused_to_its_sender(autojump_clock: Any) -> None:
    """A worker that takes nothing (its socket never written, its runner frozen): the sender waits for room at most
    WORKER_TAKE_TIMEOUT per message, then is told ``worker_stalled``; nothing goes without a word."""
    hub = Hub(BURST)

    async def frozen_agent(message: str | bytes) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        await hub.start(nursery, frozen_agent)
        started = trio.current_time()
        # one handed to the agent's socket (never written), EVENT_BACKLOG waiting, one waiting for room
        for n in range(EVENT_BACKLOG + 2):
            hub.sent_in.send_nowait(control_text(n))
        with trio.fail_after(WORKER_TAKE_TIMEOUT + WITHIN):
            await hub.told.wait()
        nursery.cancel_scope.cancel()
    assert trio.current_time() - started >= WORKER_TAKE_TIMEOUT
    assert hub.refusals() == ["worker_stalled"], hub.inbox


async def test_large_messages_wait_in_the_senders_socket_past_the_workers_byte_backlog(autojump_clock: Any) -> None:
    """The worker's backlog bounds bytes too: with 64 KiB messages to an agent that reads nothing, the hub reads no
    more than EVENT_BACKLOG_BYTES of them (plus the one in the agent's socket and the one waiting for room) in 25 s;
    by count alone (256) it read what the sender's pace allowed, about 100 of them (a room held up to 256 MiB at
    1 MiB messages). Once the agent reads, the whole burst arrives, in order."""
    size, burst = 64 * 1024, 150
    hub, agent = Hub(burst, max_data_message_bytes=2 * size), GatedAgent(burst)
    async with trio.open_nursery() as nursery:
        await hub.start(nursery, agent.socket)
        for n in range(burst):
            hub.sent_in.send_nowait(json.dumps({"topic": "tf.control", "payload": {"n": n, "pad": "x" * size}}))
        # 25 s of the autojump clock with the gate shut: the agent gets nothing meanwhile, and the sender's pace would
        # have let about 100 through; the worker's room takes fewer
        with trio.move_on_after(25):
            await agent.all_got.wait()
        assert not agent.got
        read = burst - hub.unread()
        assert read <= EVENT_BACKLOG_BYTES // size + 3, f"{read} messages of {size} bytes read for a worker that " \
                                                        f"took none"
        agent.gate.set()
        with trio.fail_after(WORKER_TAKE_TIMEOUT):
            await agent.all_got.wait()
        nursery.cancel_scope.cancel()
    assert agent.got == list(range(burst))
    assert not hub.refusals(), hub.inbox
