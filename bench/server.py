"""Server benchmarks: API cost of a session, health latency under streaming load, control-to-frame latency.

``python -m bench.server [crud] [health] [latency] [--cycles-per-client 25] [--trials 20]`` (all three by
default). The real server runs in this process: hypercorn's trio ``serve`` on 127.0.0.1:0 with
``create_app(ServerSettings(pipeline="pipelines/toy_world", max_sessions_per_worker=16, queue_size=16,
controller_timeout=3600, ...))``, local transport, toy world at its default sizes (96x160, 4 frames per chunk at
16 fps: a 250 ms chunk period). Clients run in the same process and trio loop as the server, so they share its
CPU: every figure includes the client's own cost. One JSON line per figure group.

``crud`` (figure ``create_delete_vs_trivial``)
    16 ``httpx.AsyncClient`` s, built and connected before any timing. Each does ``--cycles-per-client``
    cycles of ``POST /v1/stream/sessions`` then ``DELETE /v1/stream/sessions/{id}`` (no controller joins, so a
    cycle exercises admission, the registry, the room runner joining and leaving its room and the drain, not
    the model). The trivial route is ``GET /v1/service/health``, hit by the same 16 clients for the same number
    of HTTP requests (2 per cycle), once before and once after the cycles (both runs are pooled).

    **Ratio definition**: ``ratio_pct = 100 * (2 * cycles_per_s) / trivial_requests_per_s``, i.e. the HTTP
    request rate sustained by create+delete cycles over the rate sustained by the trivial route. The goal
    ``ratio_pct >= 50`` means a create+delete pair costs at most twice what two trivial requests cost (each
    session request at most 2x a health request). ``cycles_per_trivial_request_pct`` (cycles/s over trivial
    requests/s, without the factor 2) is printed as well. p50/p99 of each request and of a whole cycle.

``health`` (figure ``health_under_load``)
    4 toy_world sessions streaming: each controller joins its room over the WebSocket, holds a key
    (``control_state``, repeated every second as a heartbeat, the key set changing every 3 s) and reads every
    frame. Once every session has published chunks, one more client polls ``/v1/service/health`` 200 times,
    one request every 25 ms (so the polls span ~20 chunk periods). p50/p99/max in ms (goal p99 <= 25 ms), with
    the same 200 polls on the idle server first as a baseline, and the sessions' received chunk periods during
    the polls (nominal 250 ms) to show the streams kept up.

``latency`` (figure ``control_to_first_changed_frame``)
    One session, controller holding nothing: the stream pauses after its first chunk. Each trial waits for
    quiescence (no frame for 0.75 s), keeps the last frame as the reference, sends ``control_state ["d"]`` and
    times (wall clock, shared with the server's stamps) until the first received frame whose mean absolute
    difference from the previous frame (JPEG decoded with PyAV, RGB 0..255) exceeds ``CHANGE_THRESHOLD``;
    then it releases (``control_state []``). ``--trials`` trials; p50/p95 of the total and its parts:

    - ``scheduler``: the chunk's ``control_to_output_seconds`` (orchestrator: control accepted -> output emitted);
    - ``control_in``: ``publish_started_at - sent - scheduler``: the control's way in (WebSocket, room, runner,
      service wake-up until the orchestrator accepted it) plus the output's hand-off to the runner;
    - ``publish_to_frame``: ``frame received - publish_started_at``: pacing (``frame_in_chunk / fps``; 0 for the
      first frame after a pause), JPEG encode in a worker thread (``jpeg_encode_ms_est`` is measured here on a
      frame of the same size), then the WebSocket to the client. It is split with a probe that wraps
      ``server.transport.local.encode_jpeg`` for this part only (no server code changes) and stamps each encode:
      ``publish_to_encode_start`` (pacer + hand-off to the encode thread), ``encode_in_server`` (the encode as
      it ran, under load), ``encode_end_to_frame_received`` (back to the trio loop, subscriber queue, hypercorn,
      socket, client read; the frame's transport part);
    - ``status_transport``: ``chunk status received - publish_finished_at``: a text message's trip from the
      runner to the client (server queue, hypercorn, socket, client parse), the transport part alone;
    - ``chunk_publish``: ``publish_finished_at - publish_started_at`` (the whole chunk's paced publication).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any, Self

import httpx
import numpy as np
import trio

from server.settings import ServerSettings

from .clients import (
    RoomClient,
    Served,
    control_state,
    ms,
    open_controller,
    percentile,
    running_server,
)

CLIENTS = 16
HEALTH = "/v1/service/health"
SESSIONS = "/v1/stream/sessions"
LOAD_SESSIONS = 4
HEALTH_POLLS = 200
HEALTH_SPACING = 0.025
HEALTH_GOAL_MS = 25.0
RATIO_GOAL_PCT = 50.0
QUIET = 0.75
CHANGE_THRESHOLD = 1.0  # mean absolute difference (0..255) between consecutive frames
KEY_SETS = (["w"], ["d"], ["a", "j"], ["s"])


def emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def lat(values: list[float]) -> dict[str, Any]:
    return {"p50_ms": ms(percentile(values, 50)), "p99_ms": ms(percentile(values, 99)), "n": len(values)}


def settings() -> ServerSettings:
    return ServerSettings(pipeline="pipelines/toy_world", max_sessions_per_worker=16, queue_size=16,
                          controller_timeout=3600, room_empty_timeout=3600, session_timeout=86400)


# -- crud ---------------------------------------------------------------------------------------------------


async def run_trivial(clients: list[httpx.AsyncClient], per_client: int, latencies: list[float],
                      failures: list[int]) -> float:
    async def one(client: httpx.AsyncClient) -> None:
        for _ in range(per_client):
            t0 = time.perf_counter()
            response = await client.get(HEALTH)
            latencies.append(time.perf_counter() - t0)
            if response.status_code != 200:
                failures.append(response.status_code)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for client in clients:
            nursery.start_soon(one, client)
    return time.perf_counter() - start


async def run_cycles(clients: list[httpx.AsyncClient], per_client: int, creates: list[float], deletes: list[float],
                     cycles: list[float], failures: list[int], tag: str) -> float:
    async def one(index: int, client: httpx.AsyncClient) -> None:
        for k in range(per_client):
            t0 = time.perf_counter()
            response = await client.post(SESSIONS, json={"identity": f"{tag}-{index}-{k}"})
            t1 = time.perf_counter()
            creates.append(t1 - t0)
            if response.status_code not in (200, 202):
                failures.append(response.status_code)
                continue
            session_id = response.json()["session_id"]
            response = await client.delete(f"{SESSIONS}/{session_id}")
            t2 = time.perf_counter()
            deletes.append(t2 - t1)
            cycles.append(t2 - t0)
            if response.status_code != 200 or response.json().get("status") != "closed":
                failures.append(response.status_code)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index, client in enumerate(clients):
            nursery.start_soon(one, index, client)
    return time.perf_counter() - start


async def bench_crud(served: Served, per_client: int) -> None:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [httpx.AsyncClient(base_url=served.base_url, timeout=60, limits=limits) for _ in range(CLIENTS)]
    try:
        # warm up: connections open, routes and the runner code paths run once
        await run_trivial(clients, 5, [], [])
        await run_cycles(clients, 2, [], [], [], [], "warm")
        trivial_lat: list[float] = []
        trivial_fail: list[int] = []
        creates: list[float] = []
        deletes: list[float] = []
        cycles: list[float] = []
        cycle_fail: list[int] = []
        t_before = await run_trivial(clients, 2 * per_client, trivial_lat, trivial_fail)
        t_cycles = await run_cycles(clients, per_client, creates, deletes, cycles, cycle_fail, "b")
        t_after = await run_trivial(clients, 2 * per_client, trivial_lat, trivial_fail)
    finally:
        for client in clients:
            await client.aclose()
    trivial_rate = len(trivial_lat) / (t_before + t_after)
    cycle_rate = len(cycles) / t_cycles
    ratio = 100.0 * 2 * cycle_rate / trivial_rate
    emit({
        "bench": "server", "figure": "create_delete_vs_trivial",
        "clients": CLIENTS, "cycles": len(cycles), "trivial_requests": len(trivial_lat),
        "cycles_per_s": round(cycle_rate, 1),
        "cycle_http_requests_per_s": round(2 * cycle_rate, 1),
        "trivial_requests_per_s": round(trivial_rate, 1),
        "trivial_requests_per_s_before_after": [round(len(trivial_lat) / 2 / t_before, 1),
                                                round(len(trivial_lat) / 2 / t_after, 1)],
        "ratio_pct": round(ratio, 1),
        "ratio_definition": "100 * 2 * cycles_per_s / trivial_requests_per_s (HTTP request rate of create+delete "
                            "vs of GET /v1/service/health)",
        "goal_pct": RATIO_GOAL_PCT, "ok": ratio >= RATIO_GOAL_PCT,
        "cycles_per_trivial_request_pct": round(100.0 * cycle_rate / trivial_rate, 1),
        "create": lat(creates), "delete": lat(deletes), "cycle": lat(cycles), "trivial": lat(trivial_lat),
        "failures": {"cycles": cycle_fail[:10], "trivial": trivial_fail[:10]},
        "sessions_retained": len(list(served.runtime.registry)),
    })


# -- health under load --------------------------------------------------------------------------------------


class Streamer:
    def __init__(self) -> None:
        self.chunks: list[float] = []
        self.frames = 0
        self.errors: list[Any] = []


async def stream_controlled(served: Served, client: httpx.AsyncClient, index: int, stats: Streamer,
                            stop: trio.Event, ids: list[str]) -> None:
    session_id, socket = await open_controller(client, served, f"load-{index}")
    ids.append(session_id)

    async def read() -> None:
        while True:
            message = await socket.receive()
            if message is None:
                return
            if isinstance(message, bytes):
                stats.frames += 1
                continue
            payload = message.get("payload") if message.get("type") == "data" else None
            if isinstance(payload, dict):
                if payload.get("type") == "chunk":
                    stats.chunks.append(time.perf_counter())
                elif payload.get("type") in ("error", "control_rejected", "done"):
                    stats.errors.append(payload)

    async def control() -> None:
        step = index
        while True:
            keys = KEY_SETS[step % len(KEY_SETS)]
            for _ in range(3):  # every second (heartbeat), the key set changing every 3 s
                await socket.send_json(control_state(keys))
                await trio.sleep(1.0)
            step += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        nursery.start_soon(control)
        await stop.wait()
        nursery.cancel_scope.cancel()
    await socket.aclose()


async def poll_health(client: httpx.AsyncClient) -> list[float]:
    latencies: list[float] = []
    next_at = trio.current_time()
    for _ in range(HEALTH_POLLS):
        t0 = time.perf_counter()
        response = await client.get(HEALTH)
        latencies.append(time.perf_counter() - t0)
        assert response.status_code == 200, response.text
        next_at += HEALTH_SPACING
        await trio.sleep_until(next_at)
    return latencies


async def bench_health(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as client, \
            httpx.AsyncClient(base_url=served.base_url, timeout=30) as poller:
        await poller.get(HEALTH)
        idle = await poll_health(poller)
        stop = trio.Event()
        streams = [Streamer() for _ in range(LOAD_SESSIONS)]
        ids: list[str] = []
        async with trio.open_nursery() as nursery:
            for i, stats in enumerate(streams):
                nursery.start_soon(stream_controlled, served, client, i, stats, stop, ids)
            with trio.fail_after(120):
                while not all(len(s.chunks) >= 4 for s in streams):
                    await trio.sleep(0.05)
            await trio.sleep(1.0)
            mark = time.perf_counter()
            loaded = await poll_health(poller)
            periods = [b - a for s in streams for a, b in itertools.pairwise(s.chunks) if a >= mark]
            frames = sum(s.frames for s in streams)
            stop.set()
        for session_id in ids:
            await client.delete(f"{SESSIONS}/{session_id}")
    p99 = percentile(loaded, 99)
    emit({
        "bench": "server", "figure": "health_under_load",
        "sessions_streaming": LOAD_SESSIONS, "polls": len(loaded), "poll_spacing_ms": HEALTH_SPACING * 1000,
        "p50_ms": ms(percentile(loaded, 50)), "p99_ms": ms(p99), "max_ms": ms(max(loaded)),
        "goal_p99_ms": HEALTH_GOAL_MS, "ok": p99 is not None and p99 * 1000 <= HEALTH_GOAL_MS,
        "idle_p50_ms": ms(percentile(idle, 50)), "idle_p99_ms": ms(percentile(idle, 99)),
        "chunk_period_during_polls_p50_ms": ms(percentile(periods, 50), 1),
        "chunk_period_during_polls_p95_ms": ms(percentile(periods, 95), 1),
        "chunk_period_nominal_ms": 250.0, "frames_received": frames,
        "session_errors": [e for s in streams for e in s.errors][:5],
        "load_1m": round(os.getloadavg()[0], 2),
    })


# -- control to first changed frame -------------------------------------------------------------------------


def decode(jpeg: bytes) -> np.ndarray:
    import av

    context = av.CodecContext.create("mjpeg", "r")
    frames = context.decode(av.Packet(jpeg))
    return frames[0].to_ndarray(format="rgb24").astype(np.int16)


def jpeg_encode_estimate(shape: tuple[int, ...]) -> float:
    from server.transport.local import encode_jpeg

    rng = np.random.default_rng(0)
    frame = rng.integers(0, 255, size=(shape[0], shape[1], 3), dtype=np.uint8)
    times = []
    for _ in range(21):
        t0 = time.perf_counter()
        encode_jpeg(frame)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class FrameReader:
    """Reads one room socket: the last decoded frame, and the latest messages for a trial to wait on."""

    def __init__(self, socket: RoomClient) -> None:
        self.socket = socket
        self.last: np.ndarray | None = None
        self.last_frame_at = time.perf_counter()
        self.changed = trio.Event()
        self.chunk_seen = trio.Event()
        self.trial: dict[str, Any] | None = None
        self.fps = 16.0

    async def run(self) -> None:
        while True:
            message = await self.socket.receive()
            if message is None:
                return
            received = time.time()
            if isinstance(message, bytes):
                if message[:1] != b"V":
                    continue
                frame = decode(message[1:])
                previous, self.last = self.last, frame
                self.last_frame_at = time.perf_counter()
                trial = self.trial
                if trial is None or previous is None:
                    continue
                trial["frames_after_send"] += 1
                mad = float(np.abs(frame - previous).mean())
                if trial["frames_after_send"] == 1:
                    trial["first_frame_mad"] = mad
                if "changed_at" not in trial and mad > CHANGE_THRESHOLD:
                    trial["changed_at"] = received
                    trial["changed_mad"] = mad
                    trial["changed_frame_number"] = trial["frames_after_send"]
                    trial["shape"] = frame.shape
                    self.changed.set()
                continue
            payload = message.get("payload") if message.get("type") == "data" else None
            if not isinstance(payload, dict) or payload.get("type") != "chunk":
                continue
            data = payload["data"]
            self.fps = float(data.get("fps", self.fps))
            trial = self.trial
            if trial is not None and "chunk" not in trial:
                trial["chunk"] = data
                trial["chunk_received_at"] = received
                trial["frames_before_chunk_message"] = trial["frames_after_send"]
                self.chunk_seen.set()

    async def quiet(self) -> None:
        while time.perf_counter() - self.last_frame_at < QUIET:
            await trio.sleep(0.05)


class EncodeTimes:
    """Wraps ``server.transport.local.encode_jpeg`` (a measuring probe, this run only) to stamp each encode."""

    def __init__(self) -> None:
        from server.transport import local

        self.module = local
        self.original = local.encode_jpeg
        self.stamps: list[tuple[float, float]] = []  # (start, end), wall clock

    def __enter__(self) -> Self:
        original, stamps = self.original, self.stamps

        def timed(frame: Any, quality: int = 4) -> bytes:
            start = time.time()
            try:
                return original(frame, quality)
            finally:
                stamps.append((start, time.time()))

        self.module.encode_jpeg = timed
        return self

    def __exit__(self, *exc: object) -> None:
        self.module.encode_jpeg = self.original

    def nth_after(self, at: float, n: int) -> tuple[float, float] | None:
        after = sorted(s for s in self.stamps if s[0] >= at)
        return after[n - 1] if len(after) >= n else None


async def bench_latency(served: Served, trials: int) -> None:
    with EncodeTimes() as encodes:
        await _bench_latency(served, trials, encodes)


async def _bench_latency(served: Served, trials: int, encodes: EncodeTimes) -> None:
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as client:
        session_id, socket = await open_controller(client, served, "latency")
        reader = FrameReader(socket)
        results: list[dict[str, Any]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            with trio.fail_after(60):
                while reader.last is None:
                    await trio.sleep(0.05)
            for _ in range(trials):
                await reader.quiet()
                reader.changed, reader.chunk_seen = trio.Event(), trio.Event()
                trial: dict[str, Any] = {"frames_after_send": 0, "sent_at": time.time()}
                reader.trial = trial
                await socket.send_json(control_state(["d"]))
                with trio.move_on_after(10):
                    await reader.changed.wait()
                    await reader.chunk_seen.wait()
                reader.trial = None
                if "changed_frame_number" in trial:
                    trial["encode"] = encodes.nth_after(trial["sent_at"], trial["changed_frame_number"])
                await socket.send_json(control_state([]))
                results.append(trial)
            nursery.cancel_scope.cancel()
        await socket.aclose()
        await client.delete(f"{SESSIONS}/{session_id}")
    complete = [t for t in results if "changed_at" in t and "chunk" in t]
    fps = reader.fps
    shape = complete[0]["shape"] if complete else (96, 160, 3)
    encode = jpeg_encode_estimate(shape)

    def part(fn: Any) -> dict[str, Any]:
        values = [fn(t) for t in complete]
        values = [v for v in values if v is not None]
        return {"p50_ms": ms(percentile(values, 50)), "p95_ms": ms(percentile(values, 95))}

    total = [t["changed_at"] - t["sent_at"] for t in complete]

    def scheduler(t: dict[str, Any]) -> float | None:
        return t["chunk"].get("control_to_output_seconds")

    emit({
        "bench": "server", "figure": "control_to_first_changed_frame",
        "transport": "local", "trials": trials, "complete_trials": len(complete),
        "p50_ms": ms(percentile(total, 50)), "p95_ms": ms(percentile(total, 95)), "max_ms": ms(max(total, default=None)),
        "parts": {
            "control_in": part(lambda t: t["chunk"]["publish_started_at"] - t["sent_at"] - (scheduler(t) or 0.0)),
            "scheduler": part(scheduler),
            "publish_to_frame": part(lambda t: t["changed_at"] - t["chunk"]["publish_started_at"]),
            "publish_to_encode_start": part(lambda t: t["encode"][0] - t["chunk"]["publish_started_at"]
                                            if t.get("encode") else None),
            "encode_in_server": part(lambda t: t["encode"][1] - t["encode"][0] if t.get("encode") else None),
            "encode_end_to_frame_received": part(lambda t: t["changed_at"] - t["encode"][1]
                                                 if t.get("encode") else None),
            "status_transport": part(lambda t: t["chunk_received_at"] - t["chunk"]["publish_finished_at"]),
            "chunk_publish": part(lambda t: t["chunk"]["publish_finished_at"] - t["chunk"]["publish_started_at"]),
        },
        "jpeg_encode_ms_est": ms(encode, 3),
        "pacing_per_frame_ms": round(1000.0 / fps, 1),
        "changed_frame_number": sorted({t["changed_frame_number"] for t in complete}),
        "frames_before_chunk_message": sorted({t["frames_before_chunk_message"] for t in complete}),
        "applied_keys": sorted({",".join(t["chunk"]["applied_controls"]["keys"]) for t in complete}),
        "first_frame_mad_min": round(min((t["first_frame_mad"] for t in complete), default=0.0), 2),
        "change_threshold_mad": CHANGE_THRESHOLD,
        "load_1m": round(os.getloadavg()[0], 2),
    })


async def bench(parts: list[str], per_client: int, trials: int) -> None:
    async with running_server(settings()) as served:
        if "crud" in parts:
            await bench_crud(served, per_client)
        if "health" in parts:
            await bench_health(served)
        if "latency" in parts:
            await bench_latency(served, trials)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.server", description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", metavar="part", help="crud, health, latency (default: all)")
    parser.add_argument("--cycles-per-client", type=int, default=25)
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.parts) - {"crud", "health", "latency"})
    if unknown:
        parser.error(f"unknown part(s) {unknown}: choose from crud, health, latency")
    trio.run(bench, args.parts or ["crud", "health", "latency"], args.cycles_per_client, args.trials)
    return 0


if __name__ == "__main__":
    sys.exit(main())
