"""What the front costs a request: the same route through ``chunkline stream-serve`` and through plain hypercorn.

``python -m bench.front [--clients 8] [--requests 500] [--rounds 2] [--pipeline pipelines/replay]``

Each server runs as a real process on a free loopback port with the pipeline named (the test pattern by
default: no model, so the figures are the HTTP path's): ``chunkline stream-serve`` (the front reads and checks
every request head with h11 and relays it to hypercorn over a Unix socket) and ``hypercorn --worker-class trio
server:app`` (no front). Once ``/v1/service/ready`` answers 200, ``--clients`` keep-alive connections (one
trio task each, raw sockets, responses read with h11) each send ``--requests`` ``GET /v1/service/health``
one after another. The two servers alternate for ``--rounds`` rounds. One JSON line per server and round:
``requests_per_s``, ``latency_p50_ms``/``latency_p99_ms`` and ``server_cpu_us_per_request`` (the server
process's user + system CPU, from ``/proc``, over the timed requests), then a summary line with
``front_over_direct_cpu`` and ``direct_over_front_requests_per_s`` (the medians' ratios). The clients share
the host's cores with the server, so the CPU figure is the one to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h11
import trio

ROOT = Path(__file__).resolve().parent.parent
READY_DEADLINE = 120.0  # a server process imports torch and loads its pipeline before it answers
REQUEST = h11.Request(method="GET", target="/v1/service/health", headers=[("Host", "bench")])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _command(kind: str, pipeline: str, port: int) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if kind == "front":
        return [sys.executable, "-m", "server.cli", "stream-serve", pipeline, "--port", str(port)], env
    env["CHUNKLINE_PIPELINE"] = pipeline
    return [sys.executable, "-m", "hypercorn", "--worker-class", "trio", "--bind", f"127.0.0.1:{port}",
            "server:app"], env


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its descendants (hypercorn serves from a child process), from /proc."""
    total, pending = 0.0, [pid]
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # it ended meanwhile
    return total


def _wait_ready(port: int, process: subprocess.Popen) -> None:
    give_up = time.monotonic() + READY_DEADLINE
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as probe:
                probe.sendall(b"GET /v1/service/ready HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
                if probe.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > give_up:
            raise RuntimeError(f"the server did not become ready (exit {process.poll()}): {process.args}")
        time.sleep(0.2)  # bench-cost: a real process starts


async def _client(port: int, requests: int, latencies: list[float]) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    connection = h11.Connection(h11.CLIENT)
    async with stream:
        for _ in range(requests):
            started = time.perf_counter()
            await stream.send_all(connection.send(REQUEST) + connection.send(h11.EndOfMessage()))
            status = None
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    connection.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.EndOfMessage):
                    break
            if status != 200:
                raise RuntimeError(f"GET /v1/service/health answered {status}")
            latencies.append(time.perf_counter() - started)
            connection.start_next_cycle()


async def _load(port: int, clients: int, requests: int) -> list[float]:
    latencies: list[float] = []
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(_client, port, requests, latencies)
    return latencies


def measure(kind: str, pipeline: str, clients: int, requests: int) -> dict[str, Any]:
    """One server process, one timed load (after a short warm-up), its figures."""
    port = _free_port()
    command, env = _command(kind, pipeline, port)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(port, process)
        trio.run(_load, port, clients, max(1, requests // 10))  # warm-up: connections, caches
        cpu_before, started = _cpu_seconds(process.pid), time.perf_counter()
        latencies = trio.run(_load, port, clients, requests)
        wall, cpu = time.perf_counter() - started, _cpu_seconds(process.pid) - cpu_before
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    ordered = sorted(latencies)
    return {
        "figure": "front_cost", "server": kind, "clients": clients, "requests": len(ordered),
        "requests_per_s": round(len(ordered) / wall, 1),
        "latency_p50_ms": round(statistics.median(ordered) * 1e3, 3),
        "latency_p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 3),
        "server_cpu_us_per_request": round(cpu / len(ordered) * 1e6, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.front", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=500, help="requests per client and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pipeline", default="pipelines/replay")
    args = parser.parse_args(argv)
    for name in ("clients", "requests", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    lines: dict[str, list[dict[str, Any]]] = {"front": [], "direct": []}
    for _ in range(args.rounds):
        for kind in lines:
            line = measure(kind, args.pipeline, args.clients, args.requests)
            lines[kind].append(line)
            print(json.dumps(line), flush=True)

    def median(kind: str, field: str) -> float:
        return statistics.median(line[field] for line in lines[kind])

    print(json.dumps({
        "figure": "front_cost_summary", "rounds": args.rounds,
        "front_over_direct_cpu": round(median("front", "server_cpu_us_per_request")
                                       / median("direct", "server_cpu_us_per_request"), 3),
        "direct_over_front_requests_per_s": round(median("direct", "requests_per_s")
                                                  / median("front", "requests_per_s"), 3),
    }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
