"""An authority that stops in order (SIGTERM: its sessions drained) says goodbye to its agents, and an agent that
hears it dials again without counting that close toward its crash-loop limit: counted, an operator who restarted
the authority 9 times in a minute (a deploy script, an authority that crash-loops and comes back) ended every
external agent for good (exit 3 after "crash loop: 9 failures within 60 s").

One side each: a real authority process and a test peer registered as an agent; a real agent process and the test
speaking the wire as its authority, with the real proofs."""

from __future__ import annotations

import signal

import trio
import trio.testing

from server.cluster import wire
from server.cluster.agent import REREGISTER_POLICY
from server.cluster.remote import AUTHORITY_STOPPING, RemoteWorker

from .conftest import start_authority
from .test_agent_dial_ends import agent_dialing
from .wire_peer import PLAN, register
from .test_hostile_authority import AGENT_ENDED, START_DEADLINE, welcome


async def test_an_authority_that_stops_says_goodbye_to_its_agents_before_it_closes() -> None:
    authority = start_authority(launcher="external", workers=1)
    try:
        channel, reply = await register(authority, "told-goodbye")
        assert isinstance(reply, wire.Welcome), reply
        await channel.send(wire.Ready(1, "bidirectional", PLAN))
        await channel.send(wire.Heartbeat(1, ()))
        authority.process.popen.send_signal(signal.SIGTERM)
        heard: list[wire.Message] = []
        with trio.fail_after(30):
            try:
                while True:
                    heard.append(await channel.receive())
            except wire.ConnectionClosed:
                pass
        await channel.aclose()
        await trio.to_thread.run_sync(authority.process.popen.wait, 30)  # then it exits 0 (the finally checks)
        assert heard and heard[-1] == wire.Goodbye(AUTHORITY_STOPPING), (heard, authority.process.text())
    finally:
        authority.stop()


async def test_an_agent_whose_authority_stops_and_comes_back_more_often_than_its_crash_loop_limit_stays() -> None:
    times = REREGISTER_POLICY.max_failures + 2  # counted, this many closes would be a crash loop
    registrations = 0
    done = trio.Event()

    async def restarting(stream: trio.SocketStream) -> None:
        """Each connection is an authority that starts, takes the agent, then stops in order."""
        nonlocal registrations
        channel = wire.Channel(stream)
        try:
            await welcome(channel, "cluster-test-token-0123456789")
            while not isinstance(message := await channel.receive(), wire.Heartbeat):
                pass
            await channel.send(wire.HeartbeatAck(message.seq))
            registrations += 1
            if registrations > times:
                done.set()
                await trio.sleep_forever()
            await channel.send(wire.Goodbye(AUTHORITY_STOPPING))
            await channel.aclose()
        except AGENT_ENDED:
            pass

    async with agent_dialing(restarting) as agent:
        with trio.move_on_after(START_DEADLINE):
            while not done.is_set() and agent.popen.poll() is None:
                await trio.sleep(0.1)  # bench-cost: real-time poll of the agent process, bounded
        log = agent.text(200_000)
        assert done.is_set(), f"registered {registrations} times, exit code {agent.popen.poll()}:\n{log}"
        assert "the authority stopped (it said goodbye)" in log and "not counted as a crash" in log, log
        assert "crash loop" not in log and "Traceback" not in log, log


async def test_the_goodbye_follows_a_send_that_the_stop_cancelled_before_it_began() -> None:
    """The runtime's stop cancels the nursery around a connection's pump just as the pump takes a frame to send (a
    heartbeat's answer): nothing of that frame went out, so the goodbye still may and must. The pump took the
    interrupted send for a frame cut half-way and closed without it; under load the real-process test above saw the
    agent's connection close with no word (``heard == []``)."""
    authority_end, agent_end = trio.socket.socketpair()
    key = b"k" * 32
    authority_side = wire.Channel(trio.SocketStream(authority_end))
    authority_side.authenticate(key, authority=True)
    agent_side = wire.Channel(trio.SocketStream(agent_end))
    agent_side.authenticate(key, authority=False)
    worker = RemoteWorker("w-goodbye", channel=authority_side, node="n", devices=(), launcher="external", pid=1, slot=None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.pump)
        await trio.testing.wait_all_tasks_blocked()
        worker.send(wire.HeartbeatAck(1))  # the pump is handed the frame ...
        worker.stop()  # ... and the stop comes before it ran: the runtime's shutdown, then its cancel
        nursery.cancel_scope.cancel()
    heard: list[wire.Message] = []
    with trio.fail_after(5):
        try:
            while True:
                heard.append(await agent_side.receive())  # a tag out of order would be a WireError here
        except wire.ConnectionClosed:
            pass
        finally:
            await agent_side.aclose()
    assert heard == [wire.Goodbye(AUTHORITY_STOPPING)]
