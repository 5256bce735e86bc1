"""A session placed on an agent that never speaks of it again: the agent takes the Start, heartbeats, and sends no
event and no finish for it (a pipeline call its own deadlines could not cut, a bug, a hostile peer). The session held
its starting state and its worker's slot for ever; now it fails at the authority's start deadline
(``server.cluster.session_deadlines.start_deadline``), naming the worker and the deadline, the agent is told to stop
it, and the slot takes the next session. The agent still owes the stopped session's finish: it is lost at the stop's
deadline if it never sends it.

The authority runs in this process under trio's MockClock (the deadline is minutes of virtual time), over HTTP
through the app's test client; the agent is the test, speaking the wire over an in-memory stream handed to the
authority's connection handler as its listener hands it a socket.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import trio.testing

from server.app import create_app
from server.cluster import proofs, wire
from server.cluster.identity import chunkline_version, pipeline_digest, pipeline_name
from server.cluster.session_deadlines import STOP_DEADLINE, start_deadline
from server.runtime import StreamRuntime

from ..server.runner_fixtures import settings
from ..virtual_time import elapse
from .conftest import TINY, TOKEN
from .wire_peer import PLAN

INTERVAL, DEADLINE = 0.5, 4.0
CONTROLLER_TIMEOUT = 60.0
SESSIONS = "/v1/stream/sessions"


@attrs.define
class Authority:
    client: Any
    runtime: StreamRuntime

    async def json(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        response = await getattr(self.client, method)(path, **kwargs)
        return response.status_code, await response.get_json()


@asynccontextmanager
async def in_process_authority() -> AsyncIterator[Authority]:
    """``--workers external`` in this process: one expected agent, one session each, a queue of one."""
    app = create_app(settings(
        pipeline=TINY, workers="external", cluster_token=TOKEN, cluster_host="127.0.0.1", num_workers=1,
        heartbeat_interval=INTERVAL, heartbeat_deadline=DEADLINE, controller_timeout=CONTROLLER_TIMEOUT,
    ))
    async with app.test_app() as test_app:
        runtime: StreamRuntime = app.extensions["chunkline"]
        runtime.serving_at("http://127.0.0.1:9")  # where the agents would join the local rooms
        yield Authority(test_app.test_client(), runtime)


class SilentAgent:
    """Registers, says ready, answers option checks and heartbeats, and says nothing of any session it is given."""

    def __init__(self, channel: wire.Channel) -> None:
        self.channel = channel
        self.arrived, self.messages = trio.open_memory_channel[wire.Message](1000)
        self.closed = trio.Event()

    async def heartbeat(self) -> None:
        """As often as a live agent does, until the authority closes the connection."""
        seq = 0
        while True:
            seq += 1
            try:
                await self.channel.send(wire.Heartbeat(seq, ()))
            except wire.ConnectionClosed:
                return
            await trio.sleep(INTERVAL)  # bench-cost: the agent's heartbeat period, on the mock clock

    async def read(self) -> None:
        try:
            while True:
                message = await self.channel.receive()
                if isinstance(message, wire.CheckOptions):
                    await self.channel.send(wire.OptionsChecked(message.check_id))
                elif not isinstance(message, wire.HeartbeatAck):
                    self.arrived.send_nowait(message)
        except wire.ConnectionClosed:
            self.closed.set()

    async def expect(self, kind: type[wire.Message]) -> Any:
        message = await self.messages.receive()
        assert isinstance(message, kind), message
        return message


@asynccontextmanager
async def silent_agent(authority: Authority, worker_id: str) -> AsyncIterator[SilentAgent]:
    """A :class:`SilentAgent` on a connection of its own; at the end it closes the connection and the authority loses
    it (a session left on it fails) before the authority stops."""
    agent_end, authority_end = trio.testing.memory_stream_pair()
    served = trio.Event()

    async def serve() -> None:
        try:
            await authority.runtime.cluster.serve_connection(authority_end)
        finally:
            served.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        channel = wire.Channel(agent_end)
        hello = await channel.receive()
        assert isinstance(hello, wire.Hello), hello
        await channel.send(wire.Register(
            worker_id=worker_id, agent_nonce="agent-nonce", proof=proofs.proof_for(TOKEN, hello.nonce, worker_id),
            version=chunkline_version(), pipeline=pipeline_name(TINY), pipeline_digest=pipeline_digest(TINY),
            node="silent", devices=(), launcher="external", pid=1))
        welcome = await channel.receive()
        assert isinstance(welcome, wire.Welcome), welcome
        channel.authenticate(proofs.frame_key(TOKEN, hello.nonce, "agent-nonce", worker_id), authority=False)
        await channel.send(wire.Ready(1, "bidirectional", PLAN))
        agent = SilentAgent(channel)
        try:
            async with trio.open_nursery() as talking:
                talking.start_soon(agent.read)
                talking.start_soon(agent.heartbeat)
                try:
                    yield agent
                finally:
                    talking.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):  # a session still on it would hold the authority's stop
                await channel.aclose()
                with trio.fail_after(DEADLINE):
                    await served.wait()


async def test_a_session_its_agent_never_speaks_of_fails_at_the_start_deadline_and_frees_its_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    within = start_deadline(CONTROLLER_TIMEOUT)
    async with in_process_authority() as authority, silent_agent(authority, "silent") as agent:
        await elapse(INTERVAL)  # its Ready is heard
        status, created = await authority.json("post", SESSIONS, json={"identity": "alice"})
        assert status == 200 and created["worker_id"] == "silent", created
        session_id = created["session_id"]
        start = await agent.expect(wire.Start)
        assert start.session_id == session_id
        placed = trio.current_time()

        await elapse(within - 1.0)  # the agent's own deadlines are not all past yet: the session waits
        status, record = await authority.json("get", f"{SESSIONS}/{session_id}")
        assert record["status"] == "assigned", record
        status, refused = await authority.json("post", SESSIONS, json={"identity": "bob"})
        assert status == 202 and refused["queue_position"] == 1, refused  # the slot is taken: it queues

        await elapse(2.0)  # past the start deadline
        status, record = await authority.json("get", f"{SESSIONS}/{session_id}")
        assert (record["status"], record["drain_cause"]) == ("failed", "start_failed"), record
        assert record["error"] == f"worker 'silent' did not start the session within {within:g} s", record
        stop = await agent.expect(wire.Stop)
        assert (stop.session_id, stop.now) == (session_id, True), stop
        assert trio.current_time() - placed < within + 2.0
        # its slot went to the session that waited: placed on the same worker
        start = await agent.expect(wire.Start)
        assert start.session_id == refused["session_id"], start
        status, record = await authority.json("get", f"{SESSIONS}/{refused['session_id']}")
        assert (record["status"], record["worker_id"]) == ("assigned", "silent"), record

        # the agent still owes the finish of the session it was told to stop: past the stop's deadline, it is lost
        await elapse(STOP_DEADLINE + 1.0)
        assert agent.closed.is_set()
        status, metadata = await authority.json("get", "/v1/service/metadata")
        [loss] = metadata["cluster"]["recent_losses"]
        assert loss["worker_id"] == "silent", loss
        assert loss["cause"] == f"protocol error: session {session_id} not reported finished by its stop deadline"
        said = []  # and it was told why before the close (a cause of its own: it counts toward its crash-loop limit)
        with contextlib.suppress(trio.WouldBlock):
            while True:
                said.append(agent.messages.receive_nowait())  # all came before the close
        assert said == [wire.Refused(f"the authority lost this worker: {loss['cause']}")], said


async def test_an_agent_that_answers_the_late_stop_keeps_serving(autojump_clock: trio.testing.MockClock) -> None:
    """The finish of a session the authority gave up on answers the stop it was sent: the agent is not lost."""
    async with in_process_authority() as authority, silent_agent(authority, "late") as agent:
        await elapse(INTERVAL)
        status, created = await authority.json("post", SESSIONS, json={"identity": "alice"})
        assert status == 200, created
        await agent.expect(wire.Start)
        await elapse(start_deadline(CONTROLLER_TIMEOUT) + 1.0)
        stop = await agent.expect(wire.Stop)
        await agent.channel.send(wire.SessionFinished(stop.session_id, 1, None, "start_failed"))
        await elapse(STOP_DEADLINE + 1.0)
        assert not agent.closed.is_set()
        status, health = await authority.json("get", "/v1/stream/health")
        assert [w["worker_id"] for w in health["workers"]] == ["late"] and health["free_slots"] == 1, health
