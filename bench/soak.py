"""Soak: two toy_world sessions streaming with controls for a while; does anything grow?

``python -m bench.soak [--minutes 10] [--sample-seconds 10] [--warmup-seconds 60]``

The real server runs in this process (hypercorn trio ``serve`` on 127.0.0.1:0, ``create_app`` with
``pipelines/toy_world`` at its default sizes, local transport). Two controllers create a session each, join
its room over the WebSocket, and hold keys the whole time: each alternates its held set every
``KEY_PERIOD`` seconds (``control_state``) and repeats the current set every second (heartbeat). Both read
every frame and status message.

Every ``--sample-seconds`` one JSON line (``"figure": "sample"``) gives, for this process (server and
clients together):

- ``rss_mib``: ``VmRSS`` from ``/proc/self/status``;
- ``open_files``: ``len(os.listdir('/proc/self/fd'))``; ``threads``: ``threading.active_count()``;
- ``slots_in_use``: the toy world service's slot pool (``worker-0``'s service, in-process placement);
- ``chunk_period_p50_ms`` / ``chunk_period_p95_ms``: the gaps between consecutive ``chunk`` status messages
  of one session as received by its client, over the sample's window (the toy world's nominal period is
  frames_per_chunk / fps = 4 / 16 = 250 ms); ``publish_period_p95_ms`` is the same from the server's
  ``publish_finished_at`` stamps; ``frames`` received in the window; ``load_1m`` the machine's load average.

The last line (``"figure": "summary"``) compares the first sample taken at or after ``--warmup-seconds`` with
the last: ``rss_growth_pct`` (goal <= 5 %), and whether open files, threads and slots stayed flat after the
warm-up (flat: max - min <= ``FLAT_SLACK`` over those samples; the slot count must stay exactly 2), then the
slot count after both sessions are deleted (goal 0).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from typing import Any

import httpx
import trio

from server.settings import ServerSettings

from .clients import (
    control_state,
    ms,
    open_controller,
    percentile,
    running_server,
    toy_service,
)

KEY_SETS = (["w"], ["d"], ["a", "j"], ["s"], ["w", "l"], ["d", "i"])
KEY_PERIOD = 3.0
HEARTBEAT = 1.0
FLAT_SLACK = 2
SESSIONS = 2


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


class SessionStats:
    def __init__(self, name: str) -> None:
        self.name = name
        self.frames: list[float] = []  # receive times (perf_counter)
        self.chunks: list[float] = []  # receive times of chunk status messages
        self.published: list[tuple[float, float]] = []  # (receive time, server publish_finished_at) per chunk
        self.errors: list[Any] = []
        self.done = False


async def drive(served: Any, client: httpx.AsyncClient, index: int, stats: SessionStats,
                stop: trio.Event, ids: list[str]) -> None:
    session_id, socket = await open_controller(client, served, f"soak-{index}")
    ids.append(session_id)

    async def read() -> None:
        while True:
            message = await socket.receive()
            if message is None:
                stats.done = True
                return
            if isinstance(message, bytes):
                if message[:1] == b"V":
                    stats.frames.append(time.perf_counter())
                continue
            if message.get("type") != "data" or message.get("topic") != "tf.status":
                continue
            payload = message.get("payload") or {}
            kind = payload.get("type")
            if kind == "chunk":
                stats.chunks.append(time.perf_counter())
                stats.published.append((stats.chunks[-1], payload["data"]["publish_finished_at"]))
            elif kind in ("error", "done", "control_rejected"):
                stats.errors.append(payload)

    async def control() -> None:
        step = index  # the two controllers are out of phase
        while True:
            keys = KEY_SETS[step % len(KEY_SETS)]
            until = trio.current_time() + KEY_PERIOD
            while trio.current_time() < until:
                await socket.send_json(control_state(keys))
                await trio.sleep(HEARTBEAT)
            step += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        nursery.start_soon(control)
        await stop.wait()
        nursery.cancel_scope.cancel()
    await socket.aclose()


def window(values: list[float], start: float) -> list[float]:
    return [v for v in values if v >= start]


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


async def soak(minutes: float, sample_seconds: float, warmup_seconds: float) -> None:
    settings = ServerSettings(pipeline="pipelines/toy_world", max_sessions_per_worker=4, queue_size=4,
                              controller_timeout=3600, room_empty_timeout=3600, session_timeout=86400)
    async with running_server(settings) as served, httpx.AsyncClient(base_url=served.base_url, timeout=30) as client:
        service = toy_service(served)
        pool = service._stages.pool
        stop = trio.Event()
        stats = [SessionStats(f"soak-{i}") for i in range(SESSIONS)]
        ids: list[str] = []
        samples: list[dict[str, Any]] = []
        async with trio.open_nursery() as nursery:
            for i, s in enumerate(stats):
                nursery.start_soon(drive, served, client, i, s, stop, ids)
            started = time.perf_counter()
            end = started + minutes * 60.0
            next_at = started + sample_seconds
            while True:
                await trio.sleep(max(0.0, next_at - time.perf_counter()))
                window_start = next_at - sample_seconds
                periods: list[float] = []
                published: list[float] = []
                frames = chunks = 0
                for s in stats:
                    received = window(s.chunks, window_start)
                    chunks += len(received)
                    periods += gaps(received)
                    published += gaps([at for recv, at in s.published if recv >= window_start])
                    frames += len(window(s.frames, window_start))
                sample = {
                    "bench": "soak", "figure": "sample",
                    "t_s": round(time.perf_counter() - started, 1),
                    "rss_mib": round(rss_mib(), 1),
                    "open_files": open_files(),
                    "threads": threading.active_count(),
                    "slots_in_use": pool.in_use,
                    "chunks": chunks,
                    "frames": frames,
                    "chunk_period_p50_ms": ms(percentile(periods, 50), 1),
                    "chunk_period_p95_ms": ms(percentile(periods, 95), 1),
                    "publish_period_p95_ms": ms(percentile(published, 95), 1),
                    "errors": sum(len(s.errors) for s in stats),
                    "load_1m": round(os.getloadavg()[0], 2),
                }
                samples.append(sample)
                emit(sample)
                next_at += sample_seconds
                if next_at > end + 1e-6:
                    break
            stop.set()
        for session_id in ids:
            await client.delete(f"/v1/stream/sessions/{session_id}")
        with trio.move_on_after(10):
            while pool.in_use:
                await trio.sleep(0.05)
        slots_after = pool.in_use
        summary(samples, warmup_seconds, slots_after, stats)


def summary(samples: list[dict[str, Any]], warmup_seconds: float, slots_after: int, stats: list[SessionStats]) -> None:
    after = [s for s in samples if s["t_s"] >= warmup_seconds] or samples[-1:]
    first, last = after[0], samples[-1]

    def spread(key: str) -> dict[str, Any]:
        values = [s[key] for s in after]
        return {"first": values[0], "last": values[-1], "min": min(values), "max": max(values)}

    growth = (last["rss_mib"] - first["rss_mib"]) / first["rss_mib"] * 100.0
    files, threads, slots = spread("open_files"), spread("threads"), spread("slots_in_use")
    all_periods = [p for s in stats for p in gaps(s.chunks)]
    line = {
        "bench": "soak", "figure": "summary",
        "duration_s": samples[-1]["t_s"],
        "warmup_sample_t_s": first["t_s"],
        "rss_mib_first_after_warmup": first["rss_mib"], "rss_mib_last": last["rss_mib"],
        "rss_growth_pct": round(growth, 2), "rss_goal_pct": 5.0, "rss_ok": growth <= 5.0,
        "open_files": files, "open_files_flat": files["max"] - files["min"] <= FLAT_SLACK,
        "threads": threads, "threads_flat": threads["max"] - threads["min"] <= FLAT_SLACK,
        "slots_in_use": slots, "slots_flat": slots["min"] == slots["max"] == SESSIONS,
        "slots_in_use_after_delete": slots_after,
        "chunk_period_p50_ms_all": ms(percentile(all_periods, 50), 1),
        "chunk_period_p95_ms_all": ms(percentile(all_periods, 95), 1),
        "chunk_period_p99_ms_all": ms(percentile(all_periods, 99), 1),
        "chunk_period_max_ms_all": ms(max(all_periods, default=None), 1),
        "chunks_total": sum(len(s.chunks) for s in stats),
        "frames_total": sum(len(s.frames) for s in stats),
        "session_errors": [e for s in stats for e in s.errors][:5],
        "cpus": os.cpu_count(),
    }
    emit(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--warmup-seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    trio.run(soak, args.minutes, args.sample_seconds, args.warmup_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
