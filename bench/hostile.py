"""Hostile: honest clients stream while attackers try every bound at once; does anything give?

``python -m bench.hostile [--seconds 20] [--honest 2] [--pipeline pipelines/toy_world]``

A real ``chunkline stream-serve`` process (the front, hypercorn, the toy world at its default sizes, local
transport) serves ``--honest`` controllers, each holding keys and reading every frame and status message.
Three phases of ``--seconds`` each: calm, attack, calm again. During the attack, tasks loop over:

- image bombs (PNG headers claiming 60000 x 60000) and deep JSON bodies (100,000 levels) on the create route;
- reserved identities (``chunkline-worker-0``), lone surrogates, viewer-token floods past the per-session limit;
- static paths with NUL bytes and over-long names;
- room sockets: one frame declared 64 MiB long, deep JSON envelopes, spoofed ``tf.status`` from a controller,
  peers that complete the handshake and then freeze (never read, never answer a ping);
- slowloris heads, oversized heads, HTTP clients that ask for the largest static file and never read.

It prints JSON lines: ``{"figure": "phase"}`` per phase with the honest clients' chunk-period p50/p95 (the gaps
between consecutive ``chunk`` status messages of one session as received) and frames received; ``{"figure":
"resources"}`` with the server process's RSS, open files (by kind), threads and child processes before the
attack (end of the first calm phase) and after it (at least :data:`SETTLE` seconds after the attack stopped,
past every deadline the server gives a peer; the attackers' sockets are left open, as an attacker's would
be); ``{"figure": "summary"}`` with
``attack_p95_ratio`` (attack p95 / calm p95; goal <= 1.5), the count of HTTP 5xx answers (goal 0), what
each attack got back, and whether RSS/fds/threads/children returned to baseline.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import Request

from server.transport.client import RoomClient

from .clients import control_state, ms, percentile

ROOT = Path(__file__).resolve().parents[1]
SESSIONS = "/v1/stream/sessions"
KEY_SETS = (["w"], ["d"], ["a", "j"], ["s"])
RSS_SLACK = 0.10  # RSS may end 10 % above its baseline (allocator pools) and still count as back
FD_SLACK = 4
FROZEN_FOR = 20.0  # seconds a frozen peer stays silent: past the server's ping/pong deadline (15 s)
SETTLE = 35.0  # seconds after the attack before "after" is measured: past every deadline (idle connections: 30 s)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


# -- the server process --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@asynccontextmanager
async def served_process(pipeline: str, *flags: str) -> AsyncIterator[tuple[subprocess.Popen, int]]:
    """A real ``chunkline stream-serve`` of ``pipeline`` on a free loopback port, ready (or a TooSlowError after
    180 s): yields the process and its port, and stops it with SIGTERM afterwards (killed if it takes 70 s)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "stream-serve", pipeline, "--port", str(port), *flags],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            with trio.fail_after(180):
                while True:
                    try:
                        if (await http.get("/v1/service/ready")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.2)
        yield process, port
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=70)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def process_figures(pid: int) -> dict[str, Any]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    children = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children += 1
    names = collections.Counter(
        Path(f"/proc/{pid}/task/{task}/comm").read_text().strip() for task in os.listdir(f"/proc/{pid}/task")
    )
    kinds: collections.Counter[str] = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kinds[target.split(":", 1)[0] if ":" in target else "file"] += 1
    return {
        "thread_names": dict(sorted(names.items())),
        "fd_kinds": dict(sorted(kinds.items())),
        "rss_mib": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
        "open_files": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
        "children": children,
    }


# -- honest clients --------------------------------------------------------------------------------


class Honest:
    def __init__(self) -> None:
        self.chunks: list[float] = []
        self.frames = 0


async def honest_client(http: httpx.AsyncClient, host: str, port: int, index: int, stats: Honest) -> None:
    response = await http.post(SESSIONS, json={"identity": f"honest-{index}", "config": {"continuous": True}})
    response.raise_for_status()
    created = response.json()
    room = await RoomClient.connect(host, port, f"{created['websocket_path']}?token={created['token']}")

    async def keys() -> None:
        for step in range(10**9):
            await room.send_json(control_state(KEY_SETS[step % len(KEY_SETS)]))
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keys)
        while (message := await room.receive()) is not None:
            if isinstance(message, bytes):
                stats.frames += 1
            elif message.get("topic") == "tf.status" and message.get("payload", {}).get("type") == "chunk":
                stats.chunks.append(time.perf_counter())
        nursery.cancel_scope.cancel()


def periods(stats: list[Honest], start: float, end: float) -> list[float]:
    gaps: list[float] = []
    for one in stats:
        times = [t for t in one.chunks if start <= t < end]
        gaps += [b - a for a, b in zip(times, times[1:])]
    return gaps


# -- attackers -------------------------------------------------------------------------------------


def png_bomb() -> str:
    ihdr = struct.pack(">IIBBBBB", 60000, 60000, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return base64.b64encode(b"\x89PNG\r\n\x1a\n" + chunk).decode()


class Tally:
    def __init__(self) -> None:
        self.answers: collections.Counter[str] = collections.Counter()
        self.server_errors = 0

    def http(self, attack: str, status: int) -> None:
        self.answers[f"{attack}:{status}"] += 1
        if status >= 500:
            self.server_errors += 1

    def note(self, attack: str, outcome: str) -> None:
        self.answers[f"{attack}:{outcome}"] += 1


async def http_attacks(http: httpx.AsyncClient, tally: Tally) -> None:
    bomb = png_bomb()
    deep = "[" * 100_000 + "]" * 100_000
    created = (await http.post(SESSIONS, json={"identity": "victim"})).json()
    victim = created.get("session_id", "none")
    viewer = 0
    while True:
        for name, request in (
            ("image_bomb", lambda: http.post(SESSIONS, json={"identity": "bomber", "image_b64": bomb})),
            ("deep_json", lambda: http.post(SESSIONS, content=deep, headers={"Content-Type": "application/json"})),
            ("reserved_identity", lambda: http.post(SESSIONS, json={"identity": "chunkline-worker-0"})),
            ("lone_surrogate", lambda: http.post(SESSIONS, content='{"identity": "x", "prompt": "\\ud800"}',
                                                  headers={"Content-Type": "application/json"})),
            ("static_nul", lambda: http.get("/static/app.js%00.png")),
            ("static_long", lambda: http.get("/static/" + "a" * 5000)),
            ("viewer_flood", lambda: http.post(f"{SESSIONS}/{victim}/tokens", json={"identity": f"v{viewer}"})),
        ):
            response = await request()
            tally.http(name, response.status_code)
            viewer += 1
        await trio.sleep(0.05)


async def ask_upgrade(host: str, port: int, target: str, *, rcvbuf: int | None = None) -> tuple[trio.SocketStream, WSConnection]:
    """A raw socket (its receive buffer ``rcvbuf`` bytes, to play a slow reader) that has sent a WebSocket upgrade
    for ``target``; the answer is the caller's to read."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    await stream.socket.connect((host, port))
    ws = WSConnection(ConnectionType.CLIENT)
    await stream.send_all(ws.send(Request(host="x", target=target)))
    return stream, ws


async def handshake(host: str, port: int, target: str, *, rcvbuf: int | None = None) -> tuple[trio.SocketStream, WSConnection]:
    stream, ws = await ask_upgrade(host, port, target, rcvbuf=rcvbuf)
    await stream.receive_some(65536)
    return stream, ws


async def room_attacks(http: httpx.AsyncClient, host: str, port: int, tally: Tally) -> None:
    while True:
        created = (await http.post(SESSIONS, json={"identity": "mallory"})).json()
        if "websocket_path" not in created:
            tally.note("room_session", str(created.get("error")))
            await trio.sleep(0.5)
            continue
        target = f"{created['websocket_path']}?token={created['token']}"
        # one frame declared 64 MiB long: cut at the limit
        stream, _ = await handshake(host, port, target)
        await stream.send_all(bytes([0x81, 0x80 | 127]) + struct.pack(">Q", 64 << 20) + b"\x00" * 4)
        sent = 0
        with trio.move_on_after(5):
            try:
                while sent < 64 << 20:
                    await stream.send_all(b"a" * 65536)
                    sent += 65536
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        tally.note("endless_message", "cut" if sent < 4 << 20 else f"read {sent >> 20} MiB")
        await stream.aclose()
        # the session's controller: deep JSON and a spoofed tf.status; both refused, the socket kept
        room = await RoomClient.connect(host, port, target)
        await room.send_json({"topic": "tf.control", "payload": json.loads("[" * 40 + "]" * 40)})
        await room.send_json({"topic": "tf.status", "payload": {"type": "done"}})
        refusals = []
        with trio.move_on_after(5):
            while len(refusals) < 2 and (message := await room.receive()) is not None:
                if isinstance(message, dict) and message.get("type") == "refused":
                    refusals.append(message["reason"])
        tally.note("room_refusals", ",".join(refusals) or "none")
        await room.aclose()
        await http.delete(f"{SESSIONS}/{created['session_id']}")
        await trio.sleep(0.2)


async def frozen_peers(http: httpx.AsyncClient, host: str, port: int, tally: Tally) -> None:
    """Viewers of an honest session that complete the handshake and then never read nor answer."""
    listing = (await http.get(SESSIONS, params={"status": "running"})).json()["sessions"]
    if not listing:
        return
    victim = listing[0]
    index = 0
    while True:  # one frozen peer at a time, several over the attack
        token = (await http.post(f"{SESSIONS}/{victim['session_id']}/tokens", json={"identity": f"frozen-{index % 8}"})).json()
        if "token" in token:
            stream, _ = await handshake(host, port, f"/v1/rooms/{victim['room']}/ws?token={token['token']}", rcvbuf=4096)
            await trio.sleep(FROZEN_FOR)  # frozen: reads nothing, answers no ping
            outcome = "still connected"
            with trio.move_on_after(10):
                try:
                    while await stream.receive_some(65536):
                        pass
                    outcome = "sent away"
                except trio.BrokenResourceError:
                    outcome = "sent away"
            tally.note("frozen_peer", outcome)
            await stream.aclose()
        index += 1


async def raw_attacks(host: str, port: int, tally: Tally) -> None:
    while True:
        streams = []
        slow = await trio.open_tcp_stream(host, port)
        await slow.send_all(b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n")
        big = await trio.open_tcp_stream(host, port)
        await big.send_all(b"GET / HTTP/1.1\r\nX: " + b"a" * 40000 + b"\r\n\r\n")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        stalled = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        await stalled.socket.connect((host, port))
        with trio.move_on_after(1):
            await stalled.send_all(b"GET /static/vendor/livekit-client.umd.js HTTP/1.1\r\nHost: x\r\n\r\n" * 16)
        streams += [slow, big, stalled]
        for name, stream in (("slowloris", slow), ("big_head", big)):
            head = b""
            with trio.move_on_after(30):
                try:
                    while data := await stream.receive_some(65536):
                        head += data
                except trio.BrokenResourceError:
                    pass
            status = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/1.1 ") else "none"
            tally.http(name, int(status) if status.isdigit() else 0)
        for stream in streams:
            await stream.aclose()
        await trio.sleep(0.5)


# -- the run -------------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> None:
    flags = ("--max-sessions-per-worker", str(args.honest + 2), "--controller-timeout", "30")
    host = "127.0.0.1"
    tally = Tally()
    async with served_process(args.pipeline, *flags) as (process, port):
        base = f"http://{host}:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            honest = [Honest() for _ in range(args.honest)]
            async with trio.open_nursery() as nursery:
                for index, stats in enumerate(honest):
                    nursery.start_soon(honest_client, http, host, port, index, stats)
                await trio.sleep(args.seconds / 2)  # warm-up, not measured
                marks = {"calm_start": time.perf_counter()}
                await trio.sleep(args.seconds)
                marks["attack_start"] = time.perf_counter()
                before = process_figures(process.pid)
                # the attackers' own client: its connections are left open when they stop, as an attacker's are
                attack_http = httpx.AsyncClient(base_url=base, timeout=30)
                async with trio.open_nursery() as attackers:
                    attackers.start_soon(http_attacks, attack_http, tally)
                    attackers.start_soon(room_attacks, attack_http, host, port, tally)
                    attackers.start_soon(frozen_peers, attack_http, host, port, tally)
                    attackers.start_soon(raw_attacks, host, port, tally)
                    await trio.sleep(args.seconds)
                    attackers.cancel_scope.cancel()
                marks["attack_end"] = time.perf_counter()
                await trio.sleep(args.seconds)  # calm again: whatever the attackers held must be let go
                marks["end"] = time.perf_counter()
                await trio.sleep(max(0.0, SETTLE - args.seconds))
                after = process_figures(process.pid)
                await attack_http.aclose()
                nursery.cancel_scope.cancel()
            phases = {}
            for name, start, end in (("calm", "calm_start", "attack_start"), ("attack", "attack_start", "attack_end"),
                                     ("after", "attack_end", "end")):
                gaps = periods(honest, marks[start], marks[end])
                phases[name] = percentile(gaps, 95)
                emit({"figure": "phase", "phase": name, "seconds": round(marks[end] - marks[start], 1),
                      "chunk_period_p50_ms": ms(percentile(gaps, 50)), "chunk_period_p95_ms": ms(percentile(gaps, 95)),
                      "chunks": len(gaps) + len(honest)})
            emit({"figure": "resources", "before": before, "after": after})
            back = (after["rss_mib"] <= before["rss_mib"] * (1 + RSS_SLACK)
                    and after["open_files"] <= before["open_files"] + FD_SLACK
                    and after["threads"] <= before["threads"] + 2 and after["children"] <= before["children"])
            ratio = None if not phases["calm"] or not phases["attack"] else round(phases["attack"] / phases["calm"], 3)
            emit({"figure": "summary", "attack_p95_ratio": ratio, "goal_ratio": 1.5, "http_5xx": tally.server_errors,
                  "resources_back_to_baseline": back, "answers": dict(sorted(tally.answers.items())),
                  "load_1m": os.getloadavg()[0], "note": "shared 2-core machine; ratios within one run"})


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--honest", type=int, default=2, help="honest controllers streaming throughout")
    parser.add_argument("--pipeline", default="pipelines/toy_world")
    trio.run(main, parser.parse_args())


if __name__ == "__main__":
    cli()
