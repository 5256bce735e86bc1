"""What the authority shows of a session an agent hosts agrees with what it shows of one it runs itself: who is
in the room follows the room while the session runs (it was the agent's word at the session's last state
change: a viewer who came or left mid-run was not counted), and a lost agent's cause says only what the
authority knows (an agent that said it failed to start read "process exited", which nobody had seen).

Against a real ``--workers external`` authority on its local rooms, with token holders speaking the wire; and a
real agent, whose authority and room are the test's, reporting who comes and goes.
"""

from __future__ import annotations

import json
import math
import os
import signal
from typing import Any

import httpx
import pytest
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

from server.cluster import wire
from server.cluster.launch_local import LocalLauncher
from server.cluster.remote import RemoteWorker
from server.cluster.wire_values import MAX_PARTICIPANTS
from server.transport.client import RoomClient

from .conftest import TINY, TOKEN, Cluster, Controller, Process, chunkline, clean_env, until
from .test_agent_reports import ready_agent, session
from .wire_peer import closed_by_peer, losses, register
from .test_hostile_authority import AGENT_ENDED, START_DEADLINE, serve, welcome
from .test_launcher_order import Authority


@pytest.fixture(scope="module")
def authority(external_authority: Cluster) -> Cluster:
    return external_authority


async def join(authority: Cluster, created: dict[str, Any], token: str) -> Controller:
    """A client in the session's room (it answers the room's pings until it closes)."""
    ws = await RoomClient.connect("127.0.0.1", authority.port, f"{created['websocket_path']}?token={token}")
    return Controller(created, ws)


def present(authority: Cluster, session_id: str, count: int) -> Any:
    """The session's record once it counts ``count`` participants, in its own view and in the list."""
    record = session(authority, session_id)
    listed = [s for s in authority.get("/v1/stream/sessions")["sessions"] if s["session_id"] == session_id]
    return record if record["participant_count"] == count and listed[0]["participant_count"] == count else None


async def test_who_is_in_an_agent_hosted_sessions_room_follows_the_room(authority: Cluster) -> None:
    """The local rooms are the authority's own: it reads who is there, as its own runner would see them (the
    agent's worker left out), and not the agent's word (which named someone who never came). A viewer that
    left may ask for a token again and come back (a stale record said it was still in the room)."""
    async with httpx.AsyncClient(base_url=authority.base_url, timeout=30) as client, \
            ready_agent(authority, "views-room") as agent:
        created = await agent.create(client)
        assert created.status_code == 200, created.text
        start = await agent.expect(wire.Start)
        session_id = start.session_id
        controller = await join(authority, created.json(), created.json()["token"])
        for seq, event in enumerate(("join_room", "start_pipeline", "run"), 1):
            await agent.channel.send(wire.SessionEvent(session_id, seq, event, participants=("mallory", "eve")))
        await until(lambda: session(authority, session_id)["status"] == "running", "the session to run",
                    authority, deadline=30)
        await until(lambda: present(authority, session_id, 1), "the controller alone to be counted", authority,
                    deadline=30)
        token = (await client.post(f"/v1/stream/sessions/{session_id}/tokens", json={"identity": "v1"})).json()
        viewer = await join(authority, created.json(), token["token"])
        await until(lambda: present(authority, session_id, 2), "the viewer to be counted", authority, deadline=30)
        await viewer.ws.aclose()
        await until(lambda: present(authority, session_id, 1), "its leaving to be counted", authority, deadline=30)
        again = await client.post(f"/v1/stream/sessions/{session_id}/tokens", json={"identity": "v1"})
        assert again.status_code == 200, again.text
        await controller.ws.aclose()
        await until(lambda: present(authority, session_id, 0), "the room to be empty", authority, deadline=30)
        await agent.channel.send(wire.SessionFinished(session_id, 4, None, None))
        await until(lambda: session(authority, session_id)["status"] == "closed", "the session to close",
                    authority, deadline=30)
    assert "views-room" not in losses(authority)


async def test_an_agent_that_says_it_failed_is_lost_with_its_word_not_a_process_exit(authority: Cluster) -> None:
    """A Failed says the agent failed (its model worker did); nobody saw its process exit (it may still run): the
    cause says so, and the loss is counted as such."""
    channel, reply = await register(authority, "says-failed")
    assert isinstance(reply, wire.Welcome), reply
    await channel.send(wire.Failed("RuntimeError: no model"))
    assert await closed_by_peer(channel.stream, 10.0)  # type: ignore[arg-type]
    await channel.aclose()
    cause = await until(lambda: losses(authority).get("says-failed"), "the agent to be lost", authority, deadline=30)
    assert cause == "the agent said it failed: RuntimeError: no model", cause
    metrics = authority.http.get("/metrics").text
    assert 'chunkline_worker_losses_total{cause="agent_failed"} 1.0' in metrics, metrics


class Hub:
    """One room as the authority's hub serves it to a worker: the controller ``me`` is there when the agent's runner
    joins; then the test has people come and go (``say``)."""

    def __init__(self) -> None:
        self.joined = trio.Event()
        self.say_send, self._say = trio.open_memory_channel[dict[str, Any]](math.inf)

    async def one(self, stream: trio.SocketStream) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        try:
            async with trio.open_nursery() as nursery:

                async def tell() -> None:
                    async for message in self._say:
                        await stream.send_all(ws.send(TextMessage(json.dumps(message))))

                while data := await stream.receive_some(65536):
                    ws.receive_data(data)
                    for event in ws.events():
                        if isinstance(event, Request):
                            await stream.send_all(ws.send(AcceptConnection()))
                            joined = {"type": "joined", "identity": "chunkline-w", "role": "worker",
                                      "participants": ["me"]}
                            await stream.send_all(ws.send(TextMessage(json.dumps(joined))))
                            nursery.start_soon(tell)
                            self.joined.set()
                nursery.cancel_scope.cancel()
        except AGENT_ENDED:
            pass


async def test_an_agent_reports_who_comes_and_goes_bounded_in_rate_and_size() -> None:
    """Where the authority cannot see a room (LiveKit) the agent's report is all it has: a real agent reports each
    change of its running session's room (the room's members as they stand), at most one report a pause however
    fast people come and go, and never more names than the wire carries (past them it would be lost); past that
    many, those it reported before come first (the controller among them), then newcomers."""
    hub = Hub()
    reports: list[tuple[str, ...]] = []
    arrived = trio.Event()

    async def authority(stream: trio.SocketStream) -> None:
        channel = wire.Channel(stream)
        try:
            await welcome(channel, TOKEN, rooms_url=f"http://127.0.0.1:{hub_port}", deadline=30.0)
            while True:
                message = await channel.receive()  # a report past the wire's bounds fails the test here
                if isinstance(message, wire.Ready):
                    await channel.send(wire.Start(session_id="views", room="chunkline-views", identity="w",
                                                  token="t", controller_identity="me", prompt=None, config={},
                                                  image=None))
                elif isinstance(message, wire.Heartbeat):
                    await channel.send(wire.HeartbeatAck(message.seq))
                elif isinstance(message, wire.Participants | wire.SessionEvent):
                    # a change the agent saw just before a state change of its session travels with that event
                    reports.append(message.participants)
                    arrived.set()
        except AGENT_ENDED:
            pass

    async def report(expected: tuple[str, ...]) -> None:
        nonlocal arrived
        with trio.fail_after(30):
            while not reports or reports[-1] != expected:
                await arrived.wait()
                arrived = trio.Event()

    async with trio.open_nursery() as nursery:
        hub_port = await nursery.start(serve, hub.one)
        port = await nursery.start(serve, authority)
        agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{port}"),
                        clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
        try:
            with trio.fail_after(START_DEADLINE):
                await hub.joined.wait()
            hub.say_send.send_nowait({"type": "participant_joined", "identity": "v1"})
            await report(("me", "v1"))
            hub.say_send.send_nowait({"type": "participant_left", "identity": "v1"})
            await report(("me",))
            before = len(reports)
            crowd = [f"c{index:03d}" for index in range(MAX_PARTICIPANTS + 6)]
            for identity in crowd:  # 70 come and 6 of them go again, as fast as the hub can say it
                hub.say_send.send_nowait({"type": "participant_joined", "identity": identity})
            for identity in crowd[:6]:
                hub.say_send.send_nowait({"type": "participant_left", "identity": identity})
            # 65 stay: the controller, told of before, is still reported (cut by name, the 64 named before it
            # dropped it, and the authority took it as gone), and the newcomers by name fill the rest
            await report(tuple(sorted(["me", *crowd[6:6 + MAX_PARTICIPANTS - 1]])))
            assert len(reports) - before < 10, reports[before:]  # 76 changes
            hub.say_send.send_nowait({"type": "participant_left", "identity": crowd[6]})  # (the authority sent it away)
            await report(tuple(sorted(["me", *crowd[7:]])))  # the last newcomer is reported in its place
            assert all(len(one) <= MAX_PARTICIPANTS for one in reports)
        finally:
            agent.stop()
            nursery.cancel_scope.cancel()


async def test_a_launcher_names_the_signal_that_ended_its_agent_not_an_exit_code() -> None:
    """The local launcher saw its agent killed by SIGKILL: the loss read "process exited with code -9" (no process
    exits with a negative code); it names the signal. The test is the authority, the launcher and agent are real."""
    launcher = LocalLauncher([()])
    registered = trio.Event()

    async def one(stream: trio.SocketStream) -> None:
        channel = wire.Channel(stream)
        try:
            register = await welcome(channel, TOKEN)
            worker = RemoteWorker(register.worker_id, channel=channel, node=register.node, devices=register.devices,
                                  launcher=register.launcher, pid=register.pid, slot=register.slot)
            authority.registered[worker.worker_id] = worker
            launcher.worker_registered(worker)
            registered.set()
            while True:
                message = await channel.receive()
                if isinstance(message, wire.Heartbeat):
                    await channel.send(wire.HeartbeatAck(message.seq))
        except AGENT_ENDED:
            pass

    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, one)
        authority = Authority(port)
        authority.launcher = launcher
        nursery.start_soon(launcher.run, authority)
        try:
            with trio.fail_after(START_DEADLINE):
                await registered.wait()
            os.kill(launcher.pids[0], signal.SIGKILL)
            await until(lambda: authority.losses, "the launcher's notice", deadline=60)
            [(_, cause)] = authority.losses
            assert cause == "process exited: killed by signal 9 (SIGKILL)", cause
        finally:
            nursery.cancel_scope.cancel()
