"""A session's room is told once how the session ended, also when its agent fenced itself.

An agent frozen past its own fence (half the heartbeat deadline) but not the authority's stops its sessions as it runs
again, each runner telling its room ``error`` (``worker fenced: ...``), and closes its connection; the authority then
loses the agent and ended the session with its own last word: the controller got a second ``error`` (``worker lost:
connection closed``). The local room now notes that its worker said the last word, and the server says no more. A real
authority and an external agent (processes).
"""

from __future__ import annotations

import httpx
import trio

from server.cluster import wire
from states.liveness import FENCE_FRACTION

from .conftest import INTERVAL, Cluster, Controller, external_agent, stopped
from .wire_peer import register, say_ready

#: the heartbeat deadline of the fencing test's authority: wider than the module's, so that the freeze can sit well
#: inside the window between the agent's fence and the authority's loss, whatever the host's speed
FENCING_DEADLINE = 10.0
#: the latest the frozen agent fences itself, counted from the freeze: its newest acknowledged heartbeat was sent before
FENCED_BY = FENCING_DEADLINE * FENCE_FRACTION
#: the earliest the authority loses it, counted from the freeze: the last heartbeat it received was sent at most an
#: interval before
LOST_FROM = FENCING_DEADLINE - INTERVAL
#: frozen for the middle of that window: more than 2 s on each side
FROZEN = (FENCED_BY + LOST_FROM) / 2


async def test_a_session_whose_agent_fenced_itself_ends_with_one_error_in_its_room() -> None:
    async with external_agent("--heartbeat-deadline", str(FENCING_DEADLINE)) as (authority, agent), \
            httpx.AsyncClient(base_url=authority.base_url, timeout=10) as client:
        controller = await Controller.open(client, authority, "alice")
        await controller.stream(2)
        with stopped(agent.popen.pid):
            await trio.sleep(FROZEN)  # bench-cost: frozen past the agent's own fence, ~2 s short of the authority's loss
        with trio.fail_after(30):
            while await controller.next() is not None:  # to the room's close: the server sends its clients away
                pass
        errors = controller.statuses("error")
        assert len(errors) == 1, errors
        assert errors[0]["detail"].startswith("worker fenced: "), errors
        record = (await client.get(f"/v1/stream/sessions/{controller.session_id}")).json()
        assert record["status"] == "failed", record


async def test_an_agent_that_says_it_told_a_room_it_never_joined_leaves_the_last_word_to_the_server(
    external_authority: Cluster,
) -> None:
    """An agent (holding the token) reported its session joined, started, running and then finished, saying it had
    told the room, though it never joined the local room: the authority took its word, and the controller's socket
    closed with no ``done`` or ``error``. A local room the worker is not in, where it said nothing, gets the server's
    last word; one whose worker is still in it waits for what it says as it leaves."""
    authority = external_authority
    channel, reply = await register(authority, "liar")
    assert isinstance(reply, wire.Welcome), reply
    await say_ready(authority, channel, "liar")

    controller_in = trio.Event()

    async def as_the_agent() -> None:
        seq = 0

        async def beat() -> None:
            nonlocal seq
            while True:
                seq += 1
                await channel.send(wire.Heartbeat(seq, ()))
                await trio.sleep(INTERVAL)  # bench-cost: heartbeats as often as a live agent sends them

        async with trio.open_nursery() as beating:
            beating.start_soon(beat)
            while True:
                message = await channel.receive()
                if isinstance(message, wire.CheckOptions):
                    await channel.send(wire.OptionsChecked(message.check_id))
                elif isinstance(message, wire.Start):
                    for number, event in enumerate(("join_room", "start_pipeline", "run"), 1):
                        await channel.send(wire.SessionEvent(message.session_id, number, event))
                    await controller_in.wait()
                    await channel.send(wire.SessionFinished(message.session_id, 4, None, None, told_room=True))

    async with httpx.AsyncClient(base_url=authority.base_url, timeout=10) as client, trio.open_nursery() as nursery:
        nursery.start_soon(as_the_agent)
        controller = await Controller.open(client, authority, "victim")
        with trio.fail_after(30):
            while (first := await controller.next()) is not None and first.get("type") != "joined":
                pass
            controller_in.set()  # the agent says it finished only now: a room closed first refuses the join
            while await controller.next() is not None:  # to the room's close: the server sends its clients away
                pass
        nursery.cancel_scope.cancel()
    said = controller.statuses("done") + controller.statuses("error")
    assert len(said) == 1, controller.inbox
    assert said[0]["type"] == "done", said  # the session completed, as the agent said
    await channel.aclose()
