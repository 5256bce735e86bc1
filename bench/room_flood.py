"""Room floods: what many sockets together, or one controller's legal burst, make the room server do to a live session.

``python -m bench.room_flood [--seconds 10] [--sockets 64] [--viewers 8] [--viewer-rate 1048576]``

A real ``chunkline stream-serve`` process (the toy world, local rooms, one session per worker so that the
attackers' sessions wait in the queue and cost no model time) serves one honest controller holding keys and
reading every frame. Three phases of ``--seconds`` each:

- ``calm``: the honest session alone;
- ``ping_flood``: ``--sockets`` viewer sockets of the attacker's queued sessions (32 to a session) send pings
  as fast as the server takes them, reading what comes back;
- ``data_burst``: the honest session's controller sends 12,000-character data messages as fast as the server
  reads them, while ``--viewers`` honest viewers of the session
  each read at ``--viewer-rate`` bytes a second (a link of that speed) with a small receive buffer.

It prints JSON lines: ``{"figure": "phase"}`` with the honest controller's frames a second, and for
``data_burst`` how many viewers were sent away ``too_slow`` and how many data messages the server took in.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import httpx
import trio
from wsproto import WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Ping, TextMessage

from server.transport.client import RoomClient

from .clients import control_state
from .hostile import SESSIONS, ask_upgrade, emit, served_process

BIG = {"topic": "chat", "payload": "a" * 12000}  # a data message near the 12 KiB limit


async def open_socket(host: str, port: int, target: str, rcvbuf: int | None = None) -> tuple[trio.SocketStream, WSConnection]:
    """A raw WebSocket the room accepted (a refusal raises)."""
    stream, ws = await ask_upgrade(host, port, target, rcvbuf=rcvbuf)
    while True:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("refused")
        ws.receive_data(data)
        if any(isinstance(event, AcceptConnection) for event in ws.events()):
            return stream, ws


class Honest:
    def __init__(self) -> None:
        self.frames: list[float] = []


async def honest_controller(room: RoomClient, stats: Honest) -> None:
    async def keys() -> None:
        for step in range(10**9):
            await room.send_json(control_state([["w"], ["d"], ["a"], ["s"]][step % 4]))
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keys)
        while (message := await room.receive()) is not None:
            if isinstance(message, bytes) and message[:1] == b"V":
                stats.frames.append(time.perf_counter())
        nursery.cancel_scope.cancel()


async def pinger(host: str, port: int, target: str, sent: list[int]) -> None:
    try:
        stream, ws = await open_socket(host, port, target)
    except (ConnectionError, OSError):
        return
    batch = ws.send(Ping(b"p")) * 2000

    async def drain() -> None:
        while await stream.receive_some(1 << 20):
            pass

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            while True:
                await stream.send_all(batch)
                sent[0] += 2000
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


async def slow_viewer(host: str, port: int, target: str, rate: float, outcome: dict[str, int]) -> None:
    """Reads at ``rate`` bytes a second; notes whether it was sent away and why."""
    stream, ws = await open_socket(host, port, target, rcvbuf=16384)
    parts: list[str] = []
    started = time.perf_counter()
    read = 0
    try:
        while True:
            data = await stream.receive_some(16384)
            if not data:
                outcome["closed"] += 1
                return
            read += len(data)
            ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, Ping):
                    await stream.send_all(ws.send(event.response()))
                elif isinstance(event, TextMessage):
                    parts.append(event.data)
                    if event.message_finished:
                        message = json.loads("".join(parts))
                        parts.clear()
                        if message.get("type") == "refused":
                            outcome[message["reason"]] += 1
                        elif message.get("topic") == "chat":
                            outcome["chat_received"] += 1
                elif isinstance(event, CloseConnection):
                    outcome["closed"] += 1
                    return
            await trio.sleep_until(trio.current_time() + max(0.0, started + read / rate - time.perf_counter()))
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        outcome["closed"] += 1


async def main(args: argparse.Namespace) -> None:
    attacker_sessions = (args.sockets + 31) // 32
    flags = ("--max-sessions-per-worker", "1", "--queue-size", str(attacker_sessions + 1),
             "--controller-timeout", "600")
    host = "127.0.0.1"
    async with served_process(args.pipeline, *flags) as (_process, port):
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=30) as http:
            created = (await http.post(SESSIONS, json={"identity": "honest", "config": {"continuous": True}})).json()
            room = await RoomClient.connect(host, port, f"{created['websocket_path']}?token={created['token']}")
            stats = Honest()
            targets = []
            for index in range(attacker_sessions):
                queued = (await http.post(SESSIONS, json={"identity": f"mallory-{index}"})).json()
                for viewer in range(min(32, args.sockets - 32 * index)):
                    token = (await http.post(f"{SESSIONS}/{queued['session_id']}/tokens",
                                             json={"identity": f"flood-{viewer}"})).json()["token"]
                    targets.append(f"{queued['websocket_path']}?token={token}")
            viewer_targets = []
            for index in range(args.viewers):
                token = (await http.post(f"{SESSIONS}/{created['session_id']}/tokens",
                                         json={"identity": f"viewer-{index}"})).json()["token"]
                viewer_targets.append(f"{created['websocket_path']}?token={token}")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(honest_controller, room, stats)
                await trio.sleep(args.seconds / 2)  # warm-up, not measured
                marks = [("calm", time.perf_counter())]
                await trio.sleep(args.seconds)
                marks.append(("ping_flood", time.perf_counter()))
                pings = [0]
                async with trio.open_nursery() as attack:
                    for target in targets:
                        attack.start_soon(pinger, host, port, target, pings)
                    await trio.sleep(args.seconds)
                    attack.cancel_scope.cancel()
                marks.append(("recover", time.perf_counter()))
                await trio.sleep(args.seconds / 2)
                outcome: dict[str, int] = {"too_slow": 0, "closed": 0, "chat_received": 0}
                sent = 0
                async with trio.open_nursery() as burst:
                    for target in viewer_targets:
                        burst.start_soon(slow_viewer, host, port, target, args.viewer_rate, outcome)
                    await trio.sleep(1.0)
                    marks.append(("data_burst", time.perf_counter()))
                    with trio.move_on_after(args.seconds):
                        while True:
                            await room.send_json(BIG)
                            sent += 1
                    await trio.sleep(2.0)
                    burst.cancel_scope.cancel()
                marks.append(("end", time.perf_counter()))
                nursery.cancel_scope.cancel()
            for (name, start), (_, end) in zip(marks, marks[1:]):
                frames = [t for t in stats.frames if start <= t < end]
                record: dict[str, Any] = {"figure": "phase", "phase": name, "seconds": round(end - start, 1),
                                          "honest_fps": round(len(frames) / (end - start), 2)}
                if name == "ping_flood":
                    record["pings_sent"] = pings[0]
                    record["sockets"] = len(targets)
                if name == "data_burst":
                    record.update(viewers=len(viewer_targets), viewer_rate=args.viewer_rate,
                                  messages_sent=sent, **outcome)
                emit(record)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--sockets", type=int, default=64, help="the attacker's flooding sockets")
    parser.add_argument("--viewers", type=int, default=8, help="honest viewers reading during the data burst")
    parser.add_argument("--viewer-rate", type=float, default=1 << 20, help="bytes a second each viewer reads")
    parser.add_argument("--pipeline", default="pipelines/toy_world")
    trio.run(main, parser.parse_args())


if __name__ == "__main__":
    cli()
