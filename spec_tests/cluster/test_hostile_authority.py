"""A real worker agent that dialed something speaking the wire as an authority: a Start whose fields would
steer its files or break its decoding is refused with the reason, and the agent keeps serving; a peer that
cannot prove the cluster token, or frames injected between the two, never get a session started."""

from __future__ import annotations

import base64
import json
import math
import os
import signal
import socket
import struct
from pathlib import Path
from typing import Any

import trio

from server.cluster import proofs, wire

from .conftest import TINY, TOKEN, Process, chunkline, clean_env, unserved_port, until

START_DEADLINE = 240.0  # the agent imports torch and builds its model before it dials (slow on a loaded host)
#: how a fake peer here sees the agent end a connection: closed, or reset (a close with frames it never read
#: still on their way); wire.Channel says ConnectionClosed, a raw stream BrokenResourceError. Whenever the agent
#: may end a connection (it drops a peer it refuses, it exits on SIGTERM, it dials again), a fake peer's reads
#: and writes end with these, never with an error in the test's nursery; what the test asserts is its own.
AGENT_ENDED = (wire.ConnectionClosed, trio.BrokenResourceError)


async def serve(handler: Any, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``handler`` on a fresh loopback port (started with the port)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handler, listeners)


class FakeAuthority:
    """Greets one agent, welcomes it, and hands the test what the agent sends."""

    def __init__(self) -> None:
        self.channel: wire.Channel | None = None
        self.connected = trio.Event()
        self.registrations = 0
        self.done: dict[str, wire.SessionFinished] = {}
        self.arrived, self.messages = trio.open_memory_channel[wire.Message](math.inf)

    async def one(self, stream: trio.SocketStream) -> None:
        channel = wire.Channel(stream)
        try:
            await welcome(channel, TOKEN)
            self.channel = channel
            self.registrations += 1
            self.connected.set()
            while True:
                message = await channel.receive()
                if isinstance(message, wire.Heartbeat):
                    await channel.send(wire.HeartbeatAck(message.seq))
                self.arrived.send_nowait(message)
        except AGENT_ENDED:
            self.arrived.send_nowait(wire.Goodbye("connection closed"))

    async def finished(self, session_id: str) -> wire.SessionFinished:
        while session_id not in self.done:
            message = await self.messages.receive()
            if isinstance(message, wire.SessionFinished):
                self.done[message.session_id] = message
            assert not isinstance(message, wire.Goodbye), "the agent went away"
        return self.done[session_id]


async def welcome(channel: wire.Channel, token: str, *, tag: bool = True, rooms_url: str | None = None,
                  deadline: float = 30.0) -> wire.Register:
    """Greet an agent and welcome its registration as the authority does, proving ``token``; the frames after
    the welcome are tagged under it (unless ``tag`` is False: someone who wants to inject frames)."""
    await channel.send(wire.Hello("n0nce", "any"))
    register = await channel.receive()
    assert isinstance(register, wire.Register)
    await channel.send(wire.Welcome(
        worker_id=register.worker_id, heartbeat_interval=0.5, deadline=deadline, transport="local",
        rooms_url=rooms_url or f"http://127.0.0.1:{unserved_port()}", livekit_url=None, controller_timeout=5.0,
        room_empty_timeout=5.0, max_data_message_bytes=12288,
        proof=proofs.authority_proof(token, "n0nce", register.agent_nonce, register.worker_id)))
    if tag:
        channel.authenticate(proofs.frame_key(token, "n0nce", register.agent_nonce, register.worker_id), authority=True)
    return register


def start(session_id: str, image: str, suffix: str | None) -> wire.Start:
    return wire.Start(session_id=session_id, room=f"chunkline-{session_id}", identity="chunkline-w",
                      token="t", controller_identity="me", prompt=None, config={}, image=image, image_suffix=suffix)


async def test_a_start_that_would_steer_the_agents_files_or_break_its_decoding_is_refused(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    fake = FakeAuthority()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, fake.one)
        agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{port}", "--max-sessions", "2",
                                  "--drain-deadline", "5"),
                        clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN, TMPDIR=str(scratch)))
        try:
            with trio.fail_after(START_DEADLINE):
                await fake.connected.wait()
            assert fake.channel is not None
            png = base64.b64encode(b"\x89PNG not really").decode()
            # the session id is the authority's text: it must not become part of a path
            await fake.channel.send(start("../../escaped", png, ".png"))
            for session_id, image, suffix, reason in (
                ("bad-base64", "!!! not base64 !!!", ".png", "the image is not base64"),
                ("bad-suffix", png, "/../../x", "is not a file suffix"),
            ):
                await fake.channel.send(start(session_id, image, suffix))
                with trio.fail_after(60):
                    finished = await fake.finished(session_id)
                assert finished.error is not None and reason in finished.error, finished
            with trio.fail_after(60):
                await fake.finished("../../escaped")  # it ran (and failed to reach its room), and ended
            assert not list(tmp_path.glob("escaped*")), list(tmp_path.rglob("*"))
            # still serving: it heartbeats, then drains on SIGTERM and exits 0
            with trio.fail_after(30):
                while not isinstance(await fake.messages.receive(), wire.Heartbeat):
                    pass
            # a drain with a negative deadline breaks the protocol: the agent drops that connection and dials again
            frame = json.dumps({"v": wire.PROTOCOL, "type": "drain", "deadline": -1}).encode()
            await fake.channel.send_body(frame)
            with trio.fail_after(60):
                while fake.registrations < 2:
                    await trio.sleep(0.05)  # bench-cost: real-time poll of the agent process, bounded
            assert "protocol error: drain.deadline: must be a number of seconds > 0" in agent.text(200_000), agent.text()
            os.kill(agent.popen.pid, signal.SIGTERM)
            assert await trio.to_thread.run_sync(agent.popen.wait, 60) == 0, agent.text()
            assert "binascii" not in agent.text(200_000), agent.text()
            assert not list(scratch.glob("chunkline-agent-*/*")), list(scratch.rglob("*"))
        finally:
            agent.stop()
            nursery.cancel_scope.cancel()


class Impostor:
    """Answers an agent's dials, one way per connection in turn (``ways``), and records what each one heard."""

    def __init__(self, ways: list[str]) -> None:
        self.ways = ways
        self.heard: list[list[wire.Message]] = []
        self.dialed = trio.Event()

    async def one(self, stream: trio.SocketStream) -> None:
        way = self.ways[min(len(self.heard), len(self.ways) - 1)]
        heard: list[wire.Message] = []
        self.heard.append(heard)
        channel = wire.Channel(stream)
        try:
            if way == "refuse without proof":  # a Refused anyone can send
                await channel.send(wire.Hello("n0nce", "any"))
                heard.append(await channel.receive())
                await channel.send(wire.Refused("go away"))
                await channel.receive()  # the agent closes: ConnectionClosed ends this
                return
            register = await welcome(channel, TOKEN if way != "another token" else "not-the-cluster-token",
                                     tag=way == "authority")
            heard.append(register)
            if way == "inject":  # a Start sent by someone between the agent and the authority: no tag
                await channel.stream.send_all(wire.encode(start("injected", "", None)))
            elif way == "another token":
                await channel.send(start("impostor's", "", None))
            while True:
                message = await channel.receive()
                heard.append(message)
                if isinstance(message, wire.Heartbeat):
                    await channel.send(wire.HeartbeatAck(message.seq))
                    self.dialed.set()
        except (*AGENT_ENDED, wire.WireError):
            pass


async def test_an_authority_that_cannot_prove_the_token_or_injected_frames_never_start_a_session() -> None:
    impostor = Impostor(["another token", "inject", "refuse without proof", "authority"])
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, impostor.one)
        agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{port}", "--drain-deadline", "5"),
                        clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
        try:
            with trio.fail_after(START_DEADLINE):
                await impostor.dialed.wait()  # the fourth dial: the real authority's way, heartbeats acknowledged
            log = agent.text(200_000)
            assert agent.popen.poll() is None, log
            # each failed dial is dropped by the agent with a clear line, and dialed again after a backoff
            assert "did not prove the cluster token in its welcome" in log, log
            assert "does not carry its authentication tag" in log, log
            assert "refused this worker without proving the cluster token" in log and "go away" in log, log
            assert log.count("authority connection ended") == 3, log
            # neither the impostor's Start nor the injected one ran: nothing about them came back on any dial
            for heard in impostor.heard:
                assert not [m for m in heard if isinstance(m, wire.SessionEvent | wire.SessionFinished)], heard
            assert [type(m) for m in impostor.heard[0]] == [wire.Register], impostor.heard[0]
            assert [type(m) for m in impostor.heard[1]] == [wire.Register], impostor.heard[1]
            os.kill(agent.popen.pid, signal.SIGTERM)
            assert await trio.to_thread.run_sync(agent.popen.wait, 60) == 0, agent.text()
            assert "Traceback" not in agent.text(200_000), agent.text()
        finally:
            agent.stop()
            nursery.cancel_scope.cancel()


class BreakingHub:
    """One room of a hub, as the authority serves it to a worker: it admits the agent's runner with the
    controller already there, moves the controls, and resets the connection (RST) after two frames."""

    def __init__(self) -> None:
        self.frames = 0
        self.broken = trio.Event()

    async def one(self, stream: trio.SocketStream) -> None:
        from wsproto import ConnectionType, WSConnection
        from wsproto.events import AcceptConnection, BytesMessage, Request, TextMessage

        ws = WSConnection(ConnectionType.SERVER)
        try:
            while self.frames < 2:
                data = await stream.receive_some(65536)
                if not data:
                    break
                ws.receive_data(data)
                for event in ws.events():
                    if isinstance(event, Request):
                        await stream.send_all(ws.send(AcceptConnection()))
                        joined = {"type": "joined", "identity": "chunkline-w", "role": "worker", "participants": ["me"]}
                        await stream.send_all(ws.send(TextMessage(json.dumps(joined))))
                    elif isinstance(event, TextMessage) and '"running"' in event.data:
                        control = {"type": "data", "topic": "tf.control", "from": "me",
                                   "payload": {"type": "control_state", "controls": ["w"]}}
                        await stream.send_all(ws.send(TextMessage(json.dumps(control))))
                    elif isinstance(event, BytesMessage) and event.message_finished:
                        self.frames += 1
        except AGENT_ENDED:
            pass  # the agent left the room first
        if self.frames < 2:  # it left before its frames: the test fails on a hub that never broke
            await stream.aclose()
            return
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()  # a reset, as when the authority drops a lost worker's room sockets
        self.broken.set()


async def test_a_fenced_agents_broken_room_socket_is_one_log_line_without_a_traceback() -> None:
    """The room socket resets under a streaming session while the authority stops answering heartbeats (the
    agent fences itself): the session ends naming the broken room, and the agent logs no traceback."""
    hub = BreakingHub()
    fenced = trio.Event()
    finished: list[wire.SessionFinished] = []

    async def authority(stream: trio.SocketStream) -> None:
        channel = wire.Channel(stream)
        try:
            # it comes back after the fence, and may be ending (SIGTERM) in the middle of that handshake
            await welcome(channel, TOKEN, rooms_url=f"http://127.0.0.1:{hub_port}", deadline=3.0)
        except AGENT_ENDED:
            return
        if fenced.is_set():
            return  # it came back after the fence: enough
        try:
            while True:
                message = await channel.receive()
                if isinstance(message, wire.Ready):
                    await channel.send(wire.Start(session_id="breaking", room="chunkline-breaking", identity="w",
                                                  token="t", controller_identity="me", prompt=None, config={},
                                                  image=None))
                elif isinstance(message, wire.Heartbeat) and not hub.broken.is_set():
                    await channel.send(wire.HeartbeatAck(message.seq))  # none after the reset: the agent fences
                elif isinstance(message, wire.SessionFinished):
                    finished.append(message)
        except AGENT_ENDED:
            fenced.set()

    async with trio.open_nursery() as nursery:
        hub_port = await nursery.start(serve, hub.one)
        port = await nursery.start(serve, authority)
        agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{port}", "--drain-deadline", "5"),
                        clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
        try:
            with trio.move_on_after(START_DEADLINE):
                await fenced.wait()
            assert fenced.is_set() and hub.broken.is_set(), (hub.frames, finished, agent.text())
            # the agent closes the connection, then logs why: the line may trail the close
            def fence_logged() -> str | None:
                log = agent.text(200_000)
                return log if "fenced before the authority's deadline" in log else None

            log = await until(fence_logged, "the agent's log line saying it fenced itself", deadline=30.0)
            assert finished and finished[0].session_id == "breaking" and finished[0].error, finished
            assert "room" in finished[0].error, finished[0]
            assert log.count("session breaking failed") <= 1, log
            assert "Traceback" not in log, log
            # cut off again (this authority closes its later registrations), it leaves with 128 + the signal: it drained
            # nothing (states.agent.exit_status)
            os.kill(agent.popen.pid, signal.SIGTERM)
            assert await trio.to_thread.run_sync(agent.popen.wait, 60) == 128 + signal.SIGTERM, agent.text()
        finally:
            agent.stop()
            nursery.cancel_scope.cancel()
