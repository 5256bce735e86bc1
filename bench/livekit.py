"""The LiveKit transport against the local one, on a real LiveKit server: JSON lines on stdout.

    sudo .venv/bin/python -m bench.livekit [--samples 12] [--hold 6] [--rounds 3]

Needs root (a private network namespace, as the tests make) and ``make livekit-server``. Everything
that speaks WebRTC (LiveKit, the stream servers, the SDK clients) runs inside the namespace; this
process drives them over its veth pair. Each stream server is the real command,
``chunkline stream-serve bench/toy_world_sized.py``, one per transport and frame size.

Workloads (one line each, then ratios measured in the same run):

- ``latency``: control -> first changed frame, from pressing ``d`` at rest to the first decoded
  frame that differs, p50/p95 over ``--samples`` presses; LiveKit (SDK client, decoded VP8) and local
  (WebSocket client, JPEG frames) at 160x96;
- ``cpu_per_frame``: the worker process's CPU time (user + system, from /proc) per published frame
  while the controller holds ``d`` for ``--hold`` s, at 160x96 and 832x480, on both transports;
- ``viewers``: the same on LiveKit with 1, 4 and 16 viewers subscribed: the SFU fans out, so the
  worker's cost should stay flat (``ratio_to_1``, of the medians over ``--rounds`` interleaved rounds).

The machine may be shared: compare ratios from one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import trio

from server.livekit_clients import Clients, open_clients
from server.livekit_local import (
    LiveKitConfig,
    PrivateNetwork,
    find_livekit_server,
    livekit_settings_env,
    running_livekit,
    stop_process,
    wait_http_ok,
    work_folder,
)
from server.transport.client import RoomClient

from .clients import ms, percentile

ROOT = Path(__file__).resolve().parents[1]
CHUNKLINE = Path(sys.executable).with_name("chunkline")
SESSIONS = "/v1/stream/sessions"
SIZES = ("160x96", "832x480")
VIEWERS = (1, 4, 16)
QUIET = 0.6  # s without a changed frame: the view is at rest before the next press


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def stream_server(network: PrivateNetwork, port: int, size: str, workdir: Path, livekit: LiveKitConfig | None) -> Iterator[tuple[str, int]]:
    """``chunkline stream-serve`` inside the namespace on ``port``: (its URL, its pid) once ready."""
    env = {**os.environ, "CHUNKLINE_BENCH_SIZE": size, "PYTHONUNBUFFERED": "1"}
    flags = ["--transport", "local"]
    if livekit is not None:
        env.update(livekit_settings_env(livekit))
        flags = ["--transport", "livekit"]
    argv = [*network.prefix(), str(CHUNKLINE), "stream-serve", "bench/toy_world_sized.py", "--host", network.inner_ip,
            "--port", str(port), "--max-sessions-per-worker", "1", "--controller-timeout", "60", *flags]
    with open(workdir / f"stream-serve-{port}.log", "wb") as log:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{network.inner_ip}:{port}"
    try:
        wait_http_ok(url + "/v1/service/ready", 120, process)
        yield url, process.pid
    finally:
        stop_process(process, signals=(signal.SIGINT, signal.SIGTERM), grace=10.0)


async def create(url: str, identity: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=10.0, trust_env=False) as http:
        response = await http.post(SESSIONS, json={"identity": identity})
        response.raise_for_status()
        return response.json()


async def delete(url: str, session_id: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10.0, trust_env=False) as http:
        await http.delete(f"{SESSIONS}/{session_id}")
        with trio.move_on_after(20):
            while (await http.get(f"{SESSIONS}/{session_id}")).json()["status"] not in {"closed", "failed", "expired"}:
                await trio.sleep(0.2)


# -- LiveKit side ---------------------------------------------------------------------------------------


async def livekit_session(url: str, clients: Clients, name: str) -> dict[str, Any]:
    created = await create(url, name)
    await clients.join(name, created["token"])
    await clients.wait_message(name, "status", stage="running", timeout=30)
    await clients.wait_frames(name, 1, timeout=30)
    return created


async def livekit_latency(url: str, clients: Clients, samples: int) -> list[float]:
    created = await livekit_session(url, clients, "lat")
    times = []
    for _ in range(samples):
        await trio.sleep(QUIET)  # bench-cost: the view comes to rest (no key held: no new chunks)
        times.append((await clients.request("first_change", client="lat", keys=["d"], timeout=30))["seconds"])
        await clients.request("hold", client="lat", keys=[])
    await clients.request("leave", client="lat")
    await delete(url, created["session_id"])
    return times


def published_frames(clients: Clients, client: str) -> int:
    """Frames the worker published so far, from the ``chunk`` status messages ``client`` received."""
    return sum(int(m["data"]["frames"]) for m in clients.messages(client) if m.get("type") == "chunk")


async def livekit_cpu(url: str, pid: int, clients: Clients, hold: float, viewers: int = 0) -> dict[str, Any]:
    created = await livekit_session(url, clients, "cpu")
    for index in range(viewers):
        token = await viewer_token(url, created["session_id"], f"viewer-{index}")
        await clients.join(f"viewer-{index}", token, decode="none")
    await clients.request("hold", client="cpu", keys=["d"], period=0.1)
    await trio.sleep(1.0)  # bench-cost: streaming reaches its pace before measuring
    frames0, cpu0, wall0 = published_frames(clients, "cpu"), cpu_seconds(pid), time.monotonic()
    await trio.sleep(hold)
    frames1, cpu1, wall1 = published_frames(clients, "cpu"), cpu_seconds(pid), time.monotonic()
    await clients.request("hold", client="cpu", keys=[])
    for index in range(viewers):
        await clients.request("leave", client=f"viewer-{index}")
    await clients.request("leave", client="cpu")
    await delete(url, created["session_id"])
    return cpu_record(cpu1 - cpu0, frames1 - frames0, wall1 - wall0)


async def viewer_token(url: str, session_id: str, identity: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=10.0, trust_env=False) as http:
        response = await http.post(f"{SESSIONS}/{session_id}/tokens", json={"identity": identity})
        response.raise_for_status()
        return response.json()["token"]


def cpu_record(cpu: float, frames: int, wall: float) -> dict[str, Any]:
    return {"frames": frames, "fps": round(frames / wall, 2), "cpu_ms_per_frame": ms(cpu / frames) if frames else None,
            "cpu_share": round(cpu / wall, 3)}


# -- local side -------------------------------------------------------------------------------------------


class LocalRoom:
    """A local-room client whose frames a reader task hands over through a channel (so a timed-out wait
    never cuts a WebSocket message in half)."""

    def __init__(self, client: RoomClient) -> None:
        self.client = client
        self.send_frames, self.frames = trio.open_memory_channel[bytes](1024)
        self.published = 0  # frames the worker published, from its chunk status (a slow client may miss some)

    async def read(self) -> None:
        while (message := await self.client.receive()) is not None:
            if isinstance(message, bytes):
                if message[:1] == b"V":
                    await self.send_frames.send(message)
            elif message.get("type") == "data" and isinstance(payload := message.get("payload"), dict):
                if payload.get("type") == "chunk":
                    self.published += int(payload["data"]["frames"])
        self.send_frames.close()

    async def hold(self, keys: list[str]) -> None:
        await self.client.send_json({"topic": "tf.control", "payload": {"type": "control_state", "controls": keys}})

    async def next_frame(self, timeout: float = 30.0) -> bytes:
        with trio.fail_after(timeout):
            return await self.frames.receive()


@contextlib.asynccontextmanager
async def local_session(url: str, name: str) -> AsyncIterator[LocalRoom]:
    created = await create(url, name)
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    client = await RoomClient.connect(host, int(port), f"{created['websocket_path']}?token={created['token']}")
    room = LocalRoom(client)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(room.read)
            try:
                yield room
            finally:
                nursery.cancel_scope.cancel()
    finally:
        await client.aclose()
        await delete(url, created["session_id"])


async def local_latency(url: str, samples: int) -> list[float]:
    times = []
    async with local_session(url, "lat") as room:
        last = await room.next_frame()
        for _ in range(samples):
            with trio.move_on_after(QUIET):  # the view comes to rest: no frame for QUIET s
                while True:
                    last = await room.frames.receive()
            started = time.perf_counter()
            await room.hold(["d"])
            while (frame := await room.next_frame()) == last:
                pass
            times.append(time.perf_counter() - started)
            last = frame
            await room.hold([])
    return times


async def local_cpu(url: str, pid: int, hold: float) -> dict[str, Any]:
    async with local_session(url, "cpu") as room:
        await room.next_frame()
        received = 0
        async with trio.open_nursery() as nursery:
            async def heartbeat() -> None:
                while True:
                    await room.hold(["d"])
                    await trio.sleep(0.1)

            nursery.start_soon(heartbeat)
            with trio.move_on_after(1.0):  # bench-cost: streaming reaches its pace before measuring
                while True:
                    await room.frames.receive()
            frames0, cpu0, wall0 = room.published, cpu_seconds(pid), time.monotonic()
            with trio.move_on_after(hold):
                while True:
                    await room.frames.receive()
                    received += 1
            frames1, cpu1, wall1 = room.published, cpu_seconds(pid), time.monotonic()
            nursery.cancel_scope.cancel()
        await room.hold([])
    return {**cpu_record(cpu1 - cpu0, frames1 - frames0, wall1 - wall0), "received": received}


# -- the run ----------------------------------------------------------------------------------------------


def latency_record(transport: str, times: list[float]) -> dict[str, Any]:
    return {"workload": "latency", "transport": transport, "size": "160x96", "samples": len(times),
            "p50_ms": ms(percentile(times, 50)), "p95_ms": ms(percentile(times, 95))}


async def run(samples: int, hold: float, rounds: int) -> None:
    find_livekit_server()
    network = PrivateNetwork.create("chunkline-bench")
    try:
        config = LiveKitConfig(bind=network.inner_ip, node_ip=network.inner_ip)
        with work_folder("chunkline-bench-livekit-") as workdir, running_livekit(config, workdir, prefix=network.prefix()):
            async with open_clients(config, network.prefix(), workdir / "clients.stderr.log") as clients:
                results = await measure(network, config, clients, workdir, samples, hold, rounds)
        summarize(results)
    finally:
        left = network.destroy()
        if left:
            print(f"bench.livekit: killed {len(left)} process(es) left in the namespace", file=sys.stderr)


async def measure(network: PrivateNetwork, config: LiveKitConfig, clients: Clients, workdir: Path,
                  samples: int, hold: float, rounds: int) -> dict[str, Any]:
    results: dict[str, Any] = {"latency": {}, "cpu": {}, "viewers": {}}
    port = 8200
    for size in SIZES:
        for transport in ("livekit", "local"):
            port += 1
            with stream_server(network, port, size, workdir, config if transport == "livekit" else None) as (url, pid):
                if size == SIZES[0]:
                    times = await (livekit_latency(url, clients, samples) if transport == "livekit" else local_latency(url, samples))
                    results["latency"][transport] = record = latency_record(transport, times)
                    emit(record)
                cpu = await (livekit_cpu(url, pid, clients, hold) if transport == "livekit" else local_cpu(url, pid, hold))
                results["cpu"][(transport, size)] = record = {"workload": "cpu_per_frame", "transport": transport, "size": size, **cpu}
                emit(record)
                if transport == "livekit" and size == SIZES[0]:
                    results["viewers"] = await viewer_rounds(url, pid, clients, hold, rounds, size)
    return results


async def viewer_rounds(url: str, pid: int, clients: Clients, hold: float, rounds: int, size: str) -> dict[int, Any]:
    """1, 4 and 16 viewers, interleaved ``rounds`` times (a loaded machine drifts); the median per count."""
    seen: dict[int, list[dict[str, Any]]] = {viewers: [] for viewers in VIEWERS}
    for index in range(rounds):
        for viewers in VIEWERS:
            cpu = await livekit_cpu(url, pid, clients, hold, viewers=viewers)
            emit(record := {"workload": "viewers", "transport": "livekit", "size": size, "viewers": viewers, "round": index, **cpu})
            seen[viewers].append(record)
    return {viewers: sorted(records, key=lambda r: r["cpu_ms_per_frame"] or 0.0)[len(records) // 2]
            for viewers, records in seen.items()}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def summarize(results: dict[str, Any]) -> None:
    latency = results["latency"]
    emit({"workload": "latency_ratio", "livekit_over_local_p50": ratio(latency["livekit"]["p50_ms"], latency["local"]["p50_ms"]),
          "livekit_over_local_p95": ratio(latency["livekit"]["p95_ms"], latency["local"]["p95_ms"])})
    for size in SIZES:
        emit({"workload": "cpu_ratio", "size": size, "livekit_over_local": ratio(
            results["cpu"][("livekit", size)]["cpu_ms_per_frame"], results["cpu"][("local", size)]["cpu_ms_per_frame"])})
    one = results["viewers"][1]["cpu_ms_per_frame"]
    emit({"workload": "viewers_ratio", **{f"ratio_{k}_to_1": ratio(v["cpu_ms_per_frame"], one) for k, v in results["viewers"].items()}})


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.livekit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=12, help="presses per latency measurement")
    parser.add_argument("--hold", type=float, default=6.0, help="seconds each CPU measurement holds d")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the 1/4/16-viewer measurement")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("needs root: it makes a private network namespace for WebRTC")
    trio.run(run, args.samples, args.hold, args.rounds)


if __name__ == "__main__":
    main()
