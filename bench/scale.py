"""Scale-out: sessions vs agents, create latency through the authority, loss to re-admission, Ray start-up.

``python -m bench.scale [--workers 1,2,4] [--seconds 5] [--creates 40] [--no-ray]``

The authority runs in this process (``create_app`` under hypercorn on loopback, as ``stream-serve`` does);
its agents are real ``chunkline worker`` processes the local launcher starts (``--workers local``), or Ray
actors on a ``ray.cluster_utils.Cluster`` made here (``--workers ray``). The pipeline is the tiny toy
world of the agent tests (``--pipeline``), two retained sessions per agent, so that the figures are the
cluster's costs and not the model's. It prints JSON lines:

- ``{"figure": "agents"}`` per fleet size: seconds until every agent is ready, sessions admitted (HTTP 200),
  queued (202), streaming (received a frame within ``--seconds``) and the frames per second received in all;
- ``{"figure": "create_latency"}``: POST ``/v1/stream/sessions`` (then DELETE) ``--creates`` times, p50/p95
  through the authority (one agent) and with an in-process worker;
- ``{"figure": "loss"}``: two agents full, one session queued, one agent killed with SIGKILL: seconds until
  its session failed, a replacement agent registered and the queue head was admitted there;
- ``{"figure": "ray"}``: seconds to start the Ray cluster (head + two nodes), and for the authority to see
  both Ray-placed agents ready.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import httpx
import trio

from server.settings import ServerSettings

from .clients import SESSIONS, RoomClient, Served, control_state, ms, percentile, running_server

TINY = "spec_tests/cluster/tiny_world.py"
PER_AGENT = 2
READY_DEADLINE = 300.0  # seconds: agents import torch (slow on a loaded 2-core host)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def cluster_settings(pipeline: str, workers: str, count: int, **extra: Any) -> ServerSettings:
    return ServerSettings(pipeline=pipeline, workers=workers, num_workers=count, max_sessions_per_worker=PER_AGENT,
                          queue_size=8, controller_timeout=120, room_empty_timeout=120, heartbeat_interval=0.5,
                          heartbeat_deadline=3.0, **extra)


def eligible(served: Served) -> int:
    snapshot = served.runtime.book.snapshot()
    return snapshot.workers_idle + snapshot.workers_busy


async def wait_for(predicate: Any, what: str, deadline: float = READY_DEADLINE) -> float:
    """Poll ``predicate`` (real time, bounded); returns the seconds it took."""
    started = time.monotonic()
    with trio.fail_after(deadline):
        while not predicate():
            await trio.sleep(0.02)  # bench-cost: polls other processes' progress
    return time.monotonic() - started


class Viewer:
    """A controller in its room, counting frames, holding a key so that its session streams."""

    def __init__(self, created: dict[str, Any]) -> None:
        self.created = created
        self.frames = 0
        self.first_frame: float | None = None

    async def run(self, served: Served, seconds: float) -> None:
        target = f"{self.created['websocket_path']}?token={self.created['token']}"
        client = await RoomClient.connect(served.host, served.port, target)
        try:
            with trio.move_on_after(seconds):
                while (message := await client.receive()) is not None:
                    if isinstance(message, bytes):
                        self.frames += 1
                        self.first_frame = self.first_frame or time.monotonic()
                    elif isinstance(message, dict) and (message.get("payload") or {}).get("stage") == "running":
                        await client.send_json(control_state(["w"]))
        finally:
            await client.aclose()


async def create(client: httpx.AsyncClient, identity: str) -> tuple[int, dict[str, Any], float]:
    started = time.perf_counter()
    response = await client.post(SESSIONS, json={"identity": identity})
    return response.status_code, response.json(), time.perf_counter() - started


async def fleet(pipeline: str, count: int, seconds: float) -> None:
    started = time.monotonic()
    async with running_server(cluster_settings(pipeline, "local", count)) as served:
        await wait_for(lambda: eligible(served) == count, f"{count} agents")
        ready_s = time.monotonic() - started
        async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as client:
            answers = [await create(client, f"u{i}") for i in range(count * PER_AGENT + 1)]
            viewers = [Viewer(body) for status, body, _ in answers if status == 200]
            window = time.monotonic()
            async with trio.open_nursery() as nursery:
                for viewer in viewers:
                    nursery.start_soon(viewer.run, served, seconds)
            took = time.monotonic() - window
            for _, body, _ in answers:
                if "session_id" in body:
                    await client.delete(f"{SESSIONS}/{body['session_id']}")
        codes = [status for status, _, _ in answers]
        emit({"figure": "agents", "agents": count, "ready_seconds": round(ready_s, 1), "admitted": codes.count(200),
              "queued": codes.count(202), "streaming": sum(1 for v in viewers if v.frames),
              "frames_per_second": round(sum(v.frames for v in viewers) / took, 1), "window_seconds": round(took, 1)})


async def create_latency(served: Served, creates: int) -> list[float]:
    took = []
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as client:
        for i in range(creates):
            status, body, seconds = await create(client, f"c{i}")
            if status != 200:
                raise RuntimeError(f"create {i}: HTTP {status} {body}")
            took.append(seconds)
            await client.delete(f"{SESSIONS}/{body['session_id']}")
    return took


async def latency(pipeline: str, creates: int) -> None:
    figures: dict[str, Any] = {"figure": "create_latency", "creates": creates}
    for name, settings in (
        ("authority", cluster_settings(pipeline, "local", 1)),
        ("in_process", ServerSettings(pipeline=pipeline, max_sessions_per_worker=PER_AGENT, queue_size=8)),
    ):
        async with running_server(settings) as served:
            await wait_for(lambda: eligible(served) == 1, "one worker")
            took = await create_latency(served, creates)
        figures[name] = {"p50_ms": ms(percentile(took, 50)), "p95_ms": ms(percentile(took, 95))}
    emit(figures)


async def status(client: httpx.AsyncClient, session_id: str) -> str:
    return (await client.get(f"{SESSIONS}/{session_id}")).json()["status"]


async def loss(pipeline: str) -> None:
    async with running_server(cluster_settings(pipeline, "local", 2)) as served:
        await wait_for(lambda: eligible(served) == 2, "two agents")
        runtime = served.runtime
        async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as client:
            bodies = [(await create(client, f"u{i}"))[1] for i in range(2 * PER_AGENT + 1)]
            queued = bodies[-1]
            if queued["status"] != "queued":
                raise RuntimeError(f"expected the last session queued: {queued}")
            victim_id = bodies[0]["worker_id"]
            victims = [b["session_id"] for b in bodies if b.get("worker_id") == victim_id]
            pid = runtime.cluster.handles[victim_id].pid
            before = set(runtime.cluster.handles)
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            failed: float | None = None
            registered: float | None = None
            with trio.fail_after(READY_DEADLINE):
                while (state := await status(client, queued["session_id"])) == "queued":
                    now = time.monotonic()
                    if failed is None and all([await status(client, s) == "failed" for s in victims]):
                        failed = now - killed
                    if registered is None and set(runtime.cluster.handles) - before:
                        registered = now - killed
                    await trio.sleep(0.02)  # bench-cost: polls the authority
            admitted = time.monotonic() - killed
            for body in bodies:
                await client.delete(f"{SESSIONS}/{body['session_id']}")
        emit({"figure": "loss", "sessions_failed_seconds": None if failed is None else round(failed, 2),
              "replacement_registered_seconds": None if registered is None else round(registered, 2),
              "queue_head_admitted_seconds": round(admitted, 2), "queue_head_state": state})


async def ray_startup(pipeline: str) -> None:
    from ray import cluster_utils

    started = time.monotonic()
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, num_gpus=2)
        cluster.wait_for_nodes()
        cluster_s = time.monotonic() - started
        started = time.monotonic()
        settings = cluster_settings(pipeline, "ray", 2, ray_address=cluster.address, worker_gpu_map="0,1;2,3")
        async with running_server(settings) as served:
            await wait_for(lambda: eligible(served) == 2, "two ray agents")
            agents_s = time.monotonic() - started
    finally:
        cluster.shutdown()
    emit({"figure": "ray", "cluster_start_seconds": round(cluster_s, 1), "agents_ready_seconds": round(agents_s, 1)})


async def main(args: argparse.Namespace) -> None:
    for count in args.workers:
        await fleet(args.pipeline, count, args.seconds)
    await latency(args.pipeline, args.creates)
    await loss(args.pipeline)
    if not args.no_ray:
        await ray_startup(args.pipeline)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default=TINY)
    parser.add_argument("--workers", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 4])
    parser.add_argument("--seconds", type=float, default=5.0, help="streaming window per fleet size")
    parser.add_argument("--creates", type=int, default=40)
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray start-up figure")
    return parser.parse_args(argv)


if __name__ == "__main__":
    trio.run(main, parse())
