"""LiveKit clients (controllers, viewers, the RoomService) in a process of their own, driven as JSON lines.

The tests and ``bench.livekit`` run the process inside the private network namespace (WebRTC ignores
loopback, so the clients must live where the LiveKit server's non-loopback address is), while the
driver (:class:`Clients`, trio) stays outside: :func:`open_clients` starts
``ip netns exec NS python -m server.livekit_clients`` and talks to it over its stdin and stdout.

Requests: ``{"id": n, "op": ..., "client": name, ...}``; every request gets one reply
``{"id": n, "ok": true, ...}`` or ``{"id": n, "ok": false, "error": "..."}``. Unsolicited lines carry
``"event"``: ``data`` (topic, payload text, sender), ``participant_connected`` / ``_disconnected``,
``track`` (a subscribed video track), ``disconnected`` (the room went away).

Operations (one agent holds many named clients, e.g. sixteen viewers):

- ``join`` url, token, [auto_subscribe], [decode]: connect; frames of the first subscribed video
  track are counted (and, with ``decode``, the latest kept in grey levels); ``decode: "none"``
  subscribes without reading frames (a cheap viewer, for fan-out measurements);
- ``publish`` topic, payload, [reliable]: ``publish_data`` (the error is the SDK's, e.g. a grant);
- ``hold`` keys, [period]: send ``control_state`` with ``keys`` on ``tf.control`` now and every
  ``period`` s (the heartbeat), replacing the previous hold; ``keys: []`` sends one empty state and stops;
- ``flood`` key_sets, count, last: ``count`` ``control_state`` messages as fast as the SDK sends them (cycling
  through ``key_sets``), then one holding ``last``; answers the seconds it took;
- ``frames`` [grey]: frames received so far, the size, and with ``grey`` the last frame's grey levels;
- ``first_change`` keys, [timeout], [threshold]: hold ``keys`` and answer the seconds from sending the
  first control until the first decoded frame that differs from the frame shown before it;
- ``participants`` url, key, secret, room: identities in the room, as the server's RoomService lists them;
- ``remove`` url, key, secret, room, identity: the RoomService removes that participant;
- ``leave``: disconnect; ``quit``: leave every room and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import trio
from livekit import api, rtc

from .livekit_local import LiveKitConfig

REQUEST_TIMEOUT = 20.0  # one request (a join includes ICE)
#: how long a wait for what the clients see may take: a hang bound, not a measurement (a session that starts its
#: pipeline on a 2-core host under load took past 20 s once)
WAIT_TIMEOUT = 60.0

CONTROL_TOPIC = "tf.control"


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class Client:
    """One participant: a room, its first video track's frames, and a control heartbeat."""

    def __init__(self, name: str, decode: bool | str) -> None:
        self.name = name
        self.decode = decode
        self.room = rtc.Room()
        self.frames = 0
        self.size: tuple[int, int] | None = None
        self.grey: np.ndarray | None = None
        self.frame_changed = asyncio.Event()
        self._stream_task: asyncio.Task[None] | None = None
        self._hold_task: asyncio.Task[None] | None = None

    async def join(self, url: str, token: str, auto_subscribe: bool) -> dict[str, Any]:
        room = self.room
        room.on("data_received", self._on_data)
        room.on("participant_connected", lambda p: emit({"event": "participant_connected", "client": self.name, "identity": p.identity}))
        room.on("participant_disconnected", lambda p: emit({"event": "participant_disconnected", "client": self.name, "identity": p.identity}))
        room.on("track_subscribed", self._on_track)
        room.on("disconnected", lambda reason: emit({"event": "disconnected", "client": self.name, "reason": str(reason)}))
        await room.connect(url, token, rtc.RoomOptions(auto_subscribe=auto_subscribe, connect_timeout=5.0))
        return {"identity": room.local_participant.identity, "participants": sorted(p.identity for p in room.remote_participants.values())}

    def _on_data(self, packet: rtc.DataPacket) -> None:
        sender = packet.participant.identity if packet.participant is not None else None
        emit({"event": "data", "client": self.name, "topic": packet.topic, "payload": packet.data.decode("utf-8", "replace"), "sender": sender})

    def _on_track(self, track: rtc.Track, publication: rtc.RemoteTrackPublication, participant: rtc.RemoteParticipant) -> None:
        emit({"event": "track", "client": self.name, "kind": int(track.kind), "name": publication.name, "participant": participant.identity})
        if track.kind == rtc.TrackKind.KIND_VIDEO and self._stream_task is None and self.decode != "none":
            self._stream_task = asyncio.get_running_loop().create_task(self._read_video(track))

    async def _read_video(self, track: rtc.Track) -> None:
        stream = rtc.VideoStream(track, format=rtc.VideoBufferType.RGB24 if self.decode else None)
        try:
            async for event in stream:
                frame = event.frame
                self.size = (frame.width, frame.height)
                if self.decode:
                    rgb = np.frombuffer(frame.data, dtype=np.uint8).reshape(frame.height, frame.width, 3)
                    self.grey = rgb.mean(axis=2)
                self.frames += 1
                self.frame_changed.set()
                self.frame_changed = asyncio.Event()
        finally:
            await stream.aclose()

    async def publish(self, topic: str, payload: str, reliable: bool) -> None:
        await self.room.local_participant.publish_data(payload, reliable=reliable, topic=topic)

    async def _send_state(self, keys: list[str]) -> None:
        await self.publish(CONTROL_TOPIC, json.dumps({"type": "control_state", "controls": keys}), True)

    async def hold(self, keys: list[str], period: float) -> None:
        if self._hold_task is not None:
            self._hold_task.cancel()
            self._hold_task = None
        await self._send_state(keys)
        if keys:
            async def heartbeat() -> None:
                while True:
                    await asyncio.sleep(period)
                    await self._send_state(keys)

            self._hold_task = asyncio.get_running_loop().create_task(heartbeat())

    async def flood(self, key_sets: list[list[str]], count: int, last: list[str]) -> float:
        """Send ``count`` ``control_state`` messages as fast as the SDK takes them (cycling through ``key_sets``),
        then one holding ``last``; the seconds it took."""
        started = time.perf_counter()
        for index in range(count):
            await self._send_state(key_sets[index % len(key_sets)])
        await self._send_state(last)
        return time.perf_counter() - started

    async def first_change(self, keys: list[str], timeout: float, threshold: float) -> float:
        before = None if self.grey is None else self.grey.copy()
        started = time.perf_counter()
        await self.hold(keys, 0.1)
        deadline = started + timeout
        while True:
            waiter = self.frame_changed
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError(f"no changed frame within {timeout} s")
            await asyncio.wait_for(waiter.wait(), remaining)
            if before is None or self.grey is None or float(np.abs(self.grey - before).mean()) > threshold:
                return time.perf_counter() - started

    def frames_reply(self, grey: bool) -> dict[str, Any]:
        reply: dict[str, Any] = {"frames": self.frames, "size": self.size}
        if grey and self.grey is not None:
            reply["grey"] = np.round(self.grey).astype(int).tolist()
        return reply

    async def leave(self) -> None:
        if self._hold_task is not None:
            self._hold_task.cancel()
        if self._stream_task is not None:
            self._stream_task.cancel()
        await self.room.disconnect()


async def remove_participant(url: str, key: str, secret: str, room: str, identity: str) -> None:
    lkapi = api.LiveKitAPI(url.replace("ws://", "http://"), key, secret)
    try:
        await lkapi.room.remove_participant(api.RoomParticipantIdentity(room=room, identity=identity))
    finally:
        await lkapi.aclose()


async def list_participants(url: str, key: str, secret: str, room: str) -> list[str]:
    lkapi = api.LiveKitAPI(url.replace("ws://", "http://"), key, secret)
    try:
        response = await lkapi.room.list_participants(api.ListParticipantsRequest(room=room))
        return sorted(p.identity for p in response.participants)
    finally:
        await lkapi.aclose()


class ClientsServer:
    """The process side: named clients, one request at a time each (asyncio)."""

    def __init__(self) -> None:
        self.clients: dict[str, Client] = {}

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        name = request.get("client", "")
        if op == "join":
            decode = request.get("decode", True)
            client = Client(name, decode if decode == "none" else bool(decode))
            self.clients[name] = client
            return await client.join(request["url"], request["token"], bool(request.get("auto_subscribe", True)))
        if op == "participants":
            return {"identities": await list_participants(request["url"], request["key"], request["secret"], request["room"])}
        if op == "remove":
            await remove_participant(request["url"], request["key"], request["secret"], request["room"], request["identity"])
            return {}
        if op == "quit":
            for client in self.clients.values():
                await client.leave()
            return {}
        client = self.clients[name]
        if op == "publish":
            await client.publish(request["topic"], request["payload"], bool(request.get("reliable", True)))
            return {}
        if op == "hold":
            await client.hold(list(request["keys"]), float(request.get("period", 0.1)))
            return {}
        if op == "flood":
            return {"seconds": await client.flood([list(keys) for keys in request["key_sets"]], int(request["count"]),
                                                 list(request["last"]))}
        if op == "frames":
            return client.frames_reply(bool(request.get("grey", False)))
        if op == "first_change":
            seconds = await client.first_change(list(request["keys"]), float(request.get("timeout", 10.0)), float(request.get("threshold", 1.0)))
            return {"seconds": seconds}
        if op == "leave":
            await client.leave()
            del self.clients[name]
            return {}
        raise ValueError(f"unknown op {op!r}")

    async def serve(self, request: dict[str, Any]) -> None:
        try:
            reply = {"id": request.get("id"), "ok": True, **await self.handle(request)}
        except Exception as exc:  # noqa: BLE001 - every failure is the reply
            reply = {"id": request.get("id"), "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        emit(reply)


async def main() -> None:
    agent = ClientsServer()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[None]] = set()
    while line := await reader.readline():
        request = json.loads(line)
        task = loop.create_task(agent.serve(request))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if request.get("op") == "quit":
            await task
            return
    for client in agent.clients.values():  # stdin closed: the driver is gone
        await client.leave()



# -- the driver (trio, outside) ---------------------------------------------------------------------------


class ClientsError(RuntimeError):
    """The clients process answered a request with an error (the SDK's words)."""


class Clients:
    """The driver side: requests to the clients process, and the events it reported (trio)."""

    def __init__(self, process: trio.Process, config: LiveKitConfig) -> None:
        self.process = process
        self.config = config
        self.events: list[dict[str, Any]] = []
        self._replies: dict[int, dict[str, Any]] = {}
        self._arrived = trio.Event()
        self._next_id = 0

    async def read(self) -> None:
        assert self.process.stdout is not None
        buffer = b""
        async for data in self.process.stdout:
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                message = json.loads(line)
                if "event" in message:
                    self.events.append(message)
                else:
                    self._replies[message["id"]] = message
            self._arrived.set()
            self._arrived = trio.Event()

    async def request(self, op: str, timeout: float = REQUEST_TIMEOUT, **fields: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self._next_id += 1
        number = self._next_id
        await self.process.stdin.send_all(json.dumps({"id": number, "op": op, **fields}).encode() + b"\n")
        with trio.fail_after(timeout):
            while number not in self._replies:
                await self._arrived.wait()
        reply = self._replies.pop(number)
        if not reply["ok"]:
            raise ClientsError(reply["error"])
        return reply

    async def join(self, client: str, token: str, **fields: Any) -> dict[str, Any]:
        return await self.request("join", client=client, url=self.config.url, token=token, **fields)

    async def room_participants(self, room: str) -> list[str]:
        config = self.config
        reply = await self.request("participants", url=config.url, key=config.api_key, secret=config.api_secret, room=room)
        return reply["identities"]

    async def wait_frames(self, client: str, at_least: int, timeout: float = WAIT_TIMEOUT) -> int:
        """Wait until ``client`` has decoded ``at_least`` video frames; returns the count."""
        with trio.move_on_after(timeout):
            while (count := (await self.request("frames", client=client))["frames"]) < at_least:
                await trio.sleep(0.2)  # bench-cost: frames come over a real network from another process
            return count
        raise AssertionError(f"{client} decoded {count} frames in {timeout:g} s, not {at_least}")

    async def remove_participant(self, room: str, identity: str) -> None:
        config = self.config
        await self.request("remove", url=config.url, key=config.api_key, secret=config.api_secret, room=room, identity=identity)

    def messages(self, client: str, topic: str = "tf.status") -> list[dict[str, Any]]:
        """The JSON messages ``client`` received on ``topic`` so far."""
        return [json.loads(e["payload"]) for e in self.events if e["event"] == "data" and e["client"] == client and e["topic"] == topic]

    async def wait_for(self, predicate: Callable[[], Any], what: str, timeout: float = WAIT_TIMEOUT) -> Any:
        """Wait until ``predicate()`` is truthy (re-checked at each line the agent writes); returns its value."""
        with trio.move_on_after(timeout):
            while not (value := predicate()):
                await self._arrived.wait()
            return value
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")

    async def wait_message(self, client: str, kind: str, timeout: float = WAIT_TIMEOUT, topic: str = "tf.status", **match: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            for message in self.messages(client, topic):
                if message.get("type") == kind and all(message.get(k) == v or message.get("data", {}).get(k) == v for k, v in match.items()):
                    return message
            return None

        return await self.wait_for(found, f"{client}: a {kind!r} message {match or ''} on {topic}", timeout)


@contextlib.asynccontextmanager
async def open_clients(config: LiveKitConfig, prefix: Sequence[str] = (), stderr: Path | None = None) -> AsyncIterator[Clients]:
    """The clients process (run with ``prefix``, e.g. inside a namespace) and its driver, until exit."""
    root = Path(__file__).resolve().parents[1]
    with open(stderr or "/dev/null", "ab") as errors:
        process = await trio.lowlevel.open_process(
            [*prefix, sys.executable, "-m", "server.livekit_clients"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, cwd=root,
        )
    driver = Clients(process, config)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver.read)
            try:
                yield driver
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(10):
                    try:
                        await driver.request("quit", timeout=8)
                    except (ClientsError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
            await process.wait()

if __name__ == "__main__":
    asyncio.run(main())
