"""LiveKit clients in a process of their own, driven over stdin/stdout as JSON lines.

The tests and ``bench.livekit`` run this inside the private network namespace (WebRTC ignores
loopback, so the clients must live where the LiveKit server's non-loopback address is), while the
driver stays outside: ``ip netns exec NS python -m spec_tests.livekit.agent``.

Requests: ``{"id": n, "op": ..., "client": name, ...}``; every request gets one reply
``{"id": n, "ok": true, ...}`` or ``{"id": n, "ok": false, "error": "..."}``. Unsolicited lines carry
``"event"``: ``data`` (topic, payload text, sender), ``participant_connected`` / ``_disconnected``,
``track`` (a subscribed video track), ``disconnected`` (the room went away).

Operations (one agent holds many named clients, e.g. sixteen viewers):

- ``join`` url, token, [auto_subscribe], [decode]: connect; frames of the first subscribed video
  track are counted (and, with ``decode``, the latest kept in grey levels);
- ``publish`` topic, payload, [reliable]: ``publish_data`` (the error is the SDK's, e.g. a grant);
- ``hold`` keys, [period]: send ``control_state`` with ``keys`` on ``tf.control`` now and every
  ``period`` s (the heartbeat), replacing the previous hold; ``keys: []`` sends one empty state and stops;
- ``frames`` [grey]: frames received so far, the size, and with ``grey`` the last frame's grey levels;
- ``first_change`` keys, [timeout], [threshold]: hold ``keys`` and answer the seconds from sending the
  first control until the first decoded frame that differs from the frame shown before it;
- ``participants`` url, key, secret, room: identities in the room, as the server's RoomService lists them;
- ``remove`` url, key, secret, room, identity: the RoomService removes that participant;
- ``leave``: disconnect; ``quit``: leave every room and exit.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import numpy as np
from livekit import api, rtc

CONTROL_TOPIC = "tf.control"


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class Client:
    """One participant: a room, its first video track's frames, and a control heartbeat."""

    def __init__(self, name: str, decode: bool) -> None:
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
        if track.kind == rtc.TrackKind.KIND_VIDEO and self._stream_task is None:
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


class Agent:
    def __init__(self) -> None:
        self.clients: dict[str, Client] = {}

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        name = request.get("client", "")
        if op == "join":
            client = Client(name, bool(request.get("decode", True)))
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
    agent = Agent()
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


if __name__ == "__main__":
    asyncio.run(main())
