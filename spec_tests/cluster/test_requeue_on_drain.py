"""A session placed on an agent just as that agent begins its drain: the agent's Drain reaches the authority before
its refusal of the Start (START_FAILED, 'the worker is draining') on the same ordered connection, so the refusal is
the worker's state, not the session's. The session goes back to the head of the queue, keeping its id, room, token
and client, and is admitted to the next worker, where it streams (it failed: the client lost a session that
another worker could run). Several refused together keep the order they were created in, past ``--queue-size``.

The refusing agent speaks the wire itself (``server.cluster.wire``); the worker that runs the session is a real
``chunkline worker`` agent (a token holder speaking the wire, where only the order of the Starts matters).
"""

from __future__ import annotations

import itertools

import httpx
import trio

from server.cluster import wire
from server.cluster.authority import HANDSHAKE_TIMEOUT
from states.stream_session import DrainCause

from .conftest import INTERVAL, TINY, TOKEN, Cluster, Controller, Process, chunkline, clean_env, start_authority, until
from .wire_peer import PLAN, register, say_ready


async def test_a_session_its_agent_refuses_as_it_drains_is_admitted_to_the_next_worker() -> None:
    authority = await trio.to_thread.run_sync(lambda: start_authority(launcher="external", workers=1))
    agent: Process | None = None
    try:
        channel, reply = await register(authority, "refuser")
        assert isinstance(reply, wire.Welcome), reply
        await say_ready(authority, channel, "refuser")
        async with httpx.AsyncClient(base_url=authority.base_url, timeout=30) as client:
            opened: list[Controller] = []
            async with trio.open_nursery() as nursery:

                async def open_session() -> None:
                    opened.append(await Controller.open(client, authority, "alice"))

                nursery.start_soon(open_session)
                with trio.fail_after(HANDSHAKE_TIMEOUT):  # the create's options are checked by this agent first
                    while not isinstance(start := await channel.receive(), wire.Start):
                        if isinstance(start, wire.CheckOptions):
                            await channel.send(wire.OptionsChecked(start.check_id))
            [controller] = opened
            session_id = controller.session_id
            assert controller.session["worker_id"] == "refuser" and start.session_id == session_id, controller.session
            # its drain began as the Start was on its way: its Drain, then its refusal, then it leaves
            await channel.send(wire.Drain(1.0))
            await channel.send(wire.SessionFinished(session_id, 1, "the worker is draining",
                                                    DrainCause.START_FAILED.value))
            await channel.send(wire.Goodbye("drained"))
            await channel.aclose()

            def status() -> str:
                return authority.get(f"/v1/stream/sessions/{session_id}")["status"]

            await until(lambda: status() != "assigned", "the refusal to be heard", authority, deadline=10)
            record = authority.get(f"/v1/stream/sessions/{session_id}")
            assert record["status"] == "queued" and record["error"] is None, record  # not failed: it waits
            assert record["queue_position"] == 1 and record["worker_id"] is None, record
            agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{authority.cluster_port}"),
                            clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
            await controller.stream(2)  # the same client, in the same room with the same token, gets its frames
            record = authority.get(f"/v1/stream/sessions/{session_id}")
            assert record["status"] == "running" and record["worker_id"] not in (None, "refuser"), record
            assert (await client.delete(f"/v1/stream/sessions/{session_id}")).status_code == 200
    finally:
        if agent is not None:
            agent.stop()
        await trio.to_thread.run_sync(authority.stop)


class PlacedOn:
    """A token holder registered and ready with ``capacity``: it heartbeats, answers option checks and hands the test
    each session placed on it, in the order its Starts came."""

    def __init__(self, channel: wire.Channel) -> None:
        self.channel = channel
        self.arrived, self.starts = trio.open_memory_channel[wire.Start](16)

    async def heartbeat(self) -> None:
        for seq in itertools.count(1):
            try:
                await self.channel.send(wire.Heartbeat(seq, ()))
            except wire.ConnectionClosed:
                return
            await trio.sleep(INTERVAL / 2)  # bench-cost: heartbeats as often as a live agent sends them

    async def read(self) -> None:
        try:
            while True:
                message = await self.channel.receive()
                if isinstance(message, wire.CheckOptions):
                    await self.channel.send(wire.OptionsChecked(message.check_id))
                elif isinstance(message, wire.Start):
                    self.arrived.send_nowait(message)
        except wire.ConnectionClosed:
            pass

    async def start(self) -> str:
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            return (await self.starts.receive()).session_id


async def placed_on(authority: Cluster, nursery: trio.Nursery, worker_id: str, capacity: int) -> PlacedOn:
    channel, reply = await register(authority, worker_id)
    assert isinstance(reply, wire.Welcome), reply
    await channel.send(wire.Ready(capacity, "bidirectional", PLAN))
    agent = PlacedOn(channel)
    nursery.start_soon(agent.read)
    nursery.start_soon(agent.heartbeat)
    await until(lambda: any(w["worker_id"] == worker_id and w["state"] in ("idle", "busy")
                            for w in authority.workers()), f"{worker_id} to be ready", authority, deadline=10)
    return agent


async def test_sessions_an_agent_refuses_together_wait_in_the_order_they_were_created_past_the_queue_size() -> None:
    """An agent that held two sessions begins its drain and refuses both Starts: they went back to the queue's head
    one after the other, the last given back first, so the later-created session ran first. Now both wait in the
    order they were created, ahead of the session that queued behind them, though that takes the queue past
    ``--queue-size`` (1 here): sessions already admitted are not dropped for their worker's drain, and no new create
    is queued meanwhile (429, while another worker is busy). The next agent takes them in that order."""
    authority = await trio.to_thread.run_sync(
        # auto: each agent's own capacity (2 and 3 below) is taken whole, not held to the fixture's limit of 1
        lambda: start_authority("--queue-size", "1", "--max-sessions-per-worker", "auto", launcher="external", workers=1))
    agents: list[PlacedOn] = []
    try:
        async with httpx.AsyncClient(base_url=authority.base_url, timeout=30) as client, \
                trio.open_nursery() as nursery:

            async def create(identity: str) -> httpx.Response:
                return await client.post("/v1/stream/sessions", json={"identity": identity})

            agents.append(full := await placed_on(authority, nursery, "full", 1))
            zero = (await create("zero")).json()["session_id"]
            assert await full.start() == zero  # it stays busy with it
            agents.append(refuser := await placed_on(authority, nursery, "refuser", 2))
            created = []
            for identity in ("first", "second", "third"):
                response = await create(identity)
                assert response.status_code in (200, 202), response.text
                created.append(response.json()["session_id"])
            first, second, third = created
            assert [await refuser.start(), await refuser.start()] == [first, second]
            await refuser.channel.send(wire.Drain(1.0))
            for session_id in (first, second):
                await refuser.channel.send(wire.SessionFinished(session_id, 1, "the worker is draining",
                                                                DrainCause.START_FAILED.value))
            await refuser.channel.send(wire.Goodbye("drained"))

            def records() -> list[dict]:
                return [authority.get(f"/v1/stream/sessions/{session_id}") for session_id in created]

            await until(lambda: all(r["status"] == "queued" for r in records()), "the refusals to be heard", authority,
                        deadline=10)
            assert [r["queue_position"] for r in records()] == [1, 2, 3], records()
            assert authority.get("/v1/stream/health")["queued_sessions"] == 3  # past --queue-size 1
            refused = await create("fourth")
            assert refused.status_code == 429 and refused.json()["error"] == "queue_full", refused.text
            agents.append(taker := await placed_on(authority, nursery, "taker", 3))
            assert [await taker.start() for _ in created] == created
            for agent in (full, taker):  # they leave as drained agents do (their sessions fail)
                await agent.channel.send(wire.Drain(1.0))
                await agent.channel.send(wire.Goodbye("drained"))
            nursery.cancel_scope.cancel()
    finally:
        for agent in agents:
            await agent.channel.aclose()
        await trio.to_thread.run_sync(authority.stop)
