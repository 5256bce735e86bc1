"""A stop signal to a real agent before it served (loading its pipeline, dialing, waiting for the authority's
answer to its register) ends it without saying ready: it exits 128 + the signal (while it loads, at once: the load is
not waited for), and an authority that took its register hears it leave as a drained agent does, never ready. It registered anyway, ready, and drained at once:
a create landing in between was placed on an agent already leaving (``states/agent.py``).

The authority here is the test, speaking the wire (``server.cluster.wire``) with the real proofs."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from server.cluster import proofs, wire

from .conftest import TINY, TOKEN, Process, chunkline, clean_env, unserved_port
from .test_hostile_authority import AGENT_ENDED, START_DEADLINE, serve

GATED = "spec_tests/cluster/gated_world.py"
STOPPED_BEFORE_SERVING = "before this agent served"
#: seconds an agent with nothing to drain takes to exit once it may (a loaded host)
EXIT_BOUND = 60.0


class HeldAuthority:
    """Answers an agent's first dial up to ``hold`` ("hello": before its hello; "welcome": after its register, before
    the welcome), then waits for ``go``; keeps what the agent sent. Later dials are counted and closed."""

    def __init__(self, hold: str | None) -> None:
        self.hold = hold
        self.dials = 0
        self.held = trio.Event()
        self.go = trio.Event()
        self.heard: list[wire.Message] = []
        self.ended = trio.Event()

    async def answer(self, stream: trio.SocketStream) -> None:
        self.dials += 1
        channel = wire.Channel(stream)
        if self.dials > 1:
            await channel.aclose()
            return
        try:
            if self.hold == "hello":
                self.held.set()
                await self.go.wait()
            await channel.send(wire.Hello("n0nce", "any"))
            register = await channel.receive()
            self.heard.append(register)
            assert isinstance(register, wire.Register), register
            if self.hold == "welcome":
                self.held.set()
                await self.go.wait()
            await channel.send(wire.Welcome(
                worker_id=register.worker_id, heartbeat_interval=0.5, deadline=30.0, transport="local",
                rooms_url=f"http://127.0.0.1:{unserved_port()}", livekit_url=None, controller_timeout=5.0,
                room_empty_timeout=5.0, max_data_message_bytes=12288,
                proof=proofs.authority_proof(TOKEN, "n0nce", register.agent_nonce, register.worker_id)))
            channel.authenticate(proofs.frame_key(TOKEN, "n0nce", register.agent_nonce, register.worker_id),
                                 authority=True)
            while True:
                message = await channel.receive()
                if isinstance(message, wire.Heartbeat):
                    await channel.send(wire.HeartbeatAck(message.seq))
                else:
                    self.heard.append(message)
        except AGENT_ENDED:
            pass
        finally:
            self.ended.set()
            await channel.aclose()

    def said(self) -> list[str]:
        return [message.TYPE for message in self.heard]


@asynccontextmanager
async def agent_of(authority: HeldAuthority, pipeline: str, **env: str) -> AsyncIterator[Process]:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, authority.answer)
        agent = Process(chunkline("worker", pipeline, "--authority", f"tcp://127.0.0.1:{port}"),
                        clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN, **env))
        try:
            yield agent
        finally:
            agent.stop()
            nursery.cancel_scope.cancel()


async def logged(agent: Process, text: str, deadline: float) -> None:
    with trio.fail_after(deadline):
        while text not in agent.text(200_000):
            assert agent.popen.poll() is None, agent.text()
            await trio.sleep(0.05)  # bench-cost: real-time poll of the agent process, bounded


async def exit_code(agent: Process) -> int:
    code = await trio.to_thread.run_sync(agent.popen.wait, EXIT_BOUND)
    await trio.to_thread.run_sync(agent.stop)  # its log read to its end
    return code


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["SIGTERM", "SIGINT", "SIGHUP (a closed terminal)"])
async def test_a_stop_signal_while_the_agent_loads_its_pipeline_ends_it_without_a_dial(tmp_path: Path,
                                                                                       signum: int) -> None:
    authority = HeldAuthority(hold=None)
    async with agent_of(authority, GATED, GATED_WORLD=str(tmp_path)) as agent:
        with trio.fail_after(START_DEADLINE):
            while not (tmp_path / "loading").exists():
                assert agent.popen.poll() is None, agent.text()
                await trio.sleep(0.05)  # bench-cost: real-time poll of the agent process, bounded
        agent.popen.send_signal(signum)  # as it loads (before its signal handlers are in, too: the command defers it)
        try:
            code = await exit_code(agent)  # at once, the gate still shut: nothing to drain, the load not waited for
        finally:
            (tmp_path / "open").touch()
    log = agent.text(200_000)
    assert code == 128 + signum, log
    assert authority.dials == 0, (authority.said(), log)
    assert "while loading: exiting now" in log, log
    assert "registered as" not in log and "Traceback" not in log, log


@pytest.mark.parametrize("hold", ["hello", "welcome"], ids=["dialing", "awaiting its welcome"])
async def test_a_stop_signal_while_the_agent_dials_ends_it_never_ready(hold: str) -> None:
    """Before its register went out, the agent sends none; after, it hears the welcome out and leaves at once as a
    drained agent does (a drain, a goodbye), never saying ready; either way it exits 143."""
    authority = HeldAuthority(hold=hold)
    async with agent_of(authority, TINY) as agent:
        with trio.fail_after(START_DEADLINE):
            await authority.held.wait()
        agent.popen.send_signal(signal.SIGTERM)
        await logged(agent, STOPPED_BEFORE_SERVING, 30)
        authority.go.set()
        code = await exit_code(agent)
        with trio.fail_after(EXIT_BOUND):
            await authority.ended.wait()
    log = agent.text(200_000)
    assert code == 128 + signal.SIGTERM, log
    expected: list[Any] = [] if hold == "hello" else ["register", "drain", "goodbye"]
    assert authority.said() == expected, log
    assert authority.dials == 1 and "Traceback" not in log, log
