"""A session placed on an agent just as that agent begins its drain: the agent's Drain reaches the authority before
its refusal of the Start (START_FAILED, 'the worker is draining') on the same ordered connection, so the refusal is
the worker's state, not the session's. The session goes back to the head of the queue, keeping its id, room, token
and client, and is admitted to the next worker, where it streams (it failed: the client lost a session that
another worker could run).

The refusing agent speaks the wire itself (``server.cluster.wire``); the worker that runs the session is a real
``chunkline worker`` agent.
"""

from __future__ import annotations

import httpx
import trio

from server.cluster import wire
from server.cluster.authority import HANDSHAKE_TIMEOUT
from states.stream_session import DrainCause

from .conftest import TINY, TOKEN, Controller, Process, chunkline, clean_env, start_authority, until
from .test_hostile_agents import register, say_ready


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
