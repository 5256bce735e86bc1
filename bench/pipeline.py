"""The toy world served end to end on CPU, printed as JSON lines (``python -m bench.pipeline``).

- ``single``: one session, ``continuous`` for 60 chunks: real-time factor (p95 chunk period /
  chunk media duration), ``cpu_rtf`` (process CPU seconds per chunk / chunk media duration), first-output latency (create_session to the first chunk), and scheduler
  efficiency (mean chunk period / mean time of the slowest stage, from
  ``chunk.metadata["stage_times"]``; 1.0 means the slowest stage never waits).
- ``multi``: four sessions in the default ``on_input`` mode, each holding a key with its controller
  re-sending the held keys continuously, until about 60 chunks were made in all, on a service that opts
  in to lease rotation (``rotate_lease=True``; under the default rule an always-active holder keeps the
  lease, so the other three would wait by design): aggregate chunks/s, each session's largest gap
  between consecutive chunks (in its own mean chunk period -- the fairness goal is <= 2 -- and in
  single-session and aggregate chunk periods), each session's real-time factor, and
  ``starved_sessions``, how many made fewer than two chunks (their gaps cannot be measured; any is a
  fairness failure, whatever the worst gap says).

- ``placements``: one ``continuous`` session of ``PLACEMENT_CHUNKS`` chunks at a small size
  (``PLACEMENT_SIZE``) under each placement, side by side: ``in-process``, ``process`` with decode
  co-located in the denoise worker group, and ``process`` with an independent decode group fed
  through a WorkerTensorChannel (2 ranks here, so it cannot co-locate): real-time factor (p95 chunk
  period / chunk media duration), mean chunk period and startup time (``running()`` entered,
  process spawns and warm-up included).

- ``resolutions``: one ``continuous`` session per resolution (``--option resolution=WxH``: 160x96, the
  default, 320x192 and 832x480, the largest a session may ask for), ``RESOLUTION_CHUNKS`` chunks each
  after a warm-up chunk, walking forward: real-time factor (p95 chunk period / chunk media duration),
  mean chunk period, and the process CPU seconds per chunk over the chunk media duration
  (``cpu_rtf``: what the model costs when it has a core to itself, a fairer figure on a shared machine),
  and each one's ratio to the default resolution's figures from the same run.

Wall clock (``time.perf_counter``) throughout; the toy world at its default size except for
``placements`` and ``resolutions``. ``python -m bench.pipeline placements`` prints only that line;
``python -m bench.pipeline resolutions [DEVICE]`` only that one (``DEVICE`` e.g. ``cuda``, default ``cpu``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from contextlib import aclosing
from typing import Any

import trio

from engine.metrics import percentile
from pipelines.contract import Control, ControlType, SessionConfig
from pipelines.toy_world import get_service

CHUNKS = 60
SESSIONS = 4
RESEND_SECONDS = 0.05  # how often a controller re-sends its held keys
MULTI_LIMIT_SECONDS = 120.0
PLACEMENT_CHUNKS = 24
PLACEMENT_SIZE = dict(height=48, width=80, frames_per_chunk=4)
RESOLUTIONS = ("160x96", "320x192", "832x480")
RESOLUTION_CHUNKS = 24


def placement(mode: str, decode_devices: list[str]) -> dict[str, Any]:
    runtime = {"devices": ["cpu"], "world_size": 1}
    return {"mode": mode, "encode": runtime, "denoise": runtime, "decode": {"devices": decode_devices}}


PLACEMENTS = {
    "in_process": placement("in-process", ["cpu"]),
    "process_colocated": placement("process", ["cpu"]),
    "process_independent": placement("process", ["cpu", "cpu"]),
}


def emit(line: dict[str, Any]) -> None:
    def fmt(value: Any) -> Any:
        if isinstance(value, float):
            return round(value, 4)
        if isinstance(value, dict):
            return {k: fmt(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fmt(v) for v in value]
        return value

    print(json.dumps({k: fmt(v) for k, v in line.items()}), flush=True)


def periods(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


async def single(service: Any) -> dict[str, Any]:
    start = time.perf_counter()
    session_id = await service.create_session(SessionConfig(options={"continuous": True, "chunks": CHUNKS}))
    arrivals: list[float] = []
    cpu: list[float] = []
    stage_times: list[dict[str, float]] = []
    media = 0.0
    async with aclosing(service.chunks(session_id)) as chunks:
        async for chunk in chunks:
            arrivals.append(time.perf_counter())
            cpu.append(time.process_time())
            stage_times.append(dict(chunk.metadata.get("stage_times", {})))
            media = chunk.media_seconds
    await service.close_session(session_id)
    gaps = sorted(periods(arrivals))
    stage_means = {
        stage: statistics.fmean(t[stage] for t in stage_times if stage in t)
        for stage in ("encode", "denoise", "decode")
        if any(stage in t for t in stage_times)
    }
    slowest = max(stage_means, key=stage_means.__getitem__)
    mean_period = statistics.fmean(gaps)
    return {
        "bench": "pipeline.single",
        "chunks": len(arrivals),
        "chunk_media_seconds": media,
        "mean_chunk_period_s": mean_period,
        "p95_chunk_period_s": percentile(gaps, 0.95),
        "real_time_factor": percentile(gaps, 0.95) / media,
        "cpu_rtf": (cpu[-1] - cpu[0]) / (len(cpu) - 1) / media,
        "first_output_latency_s": arrivals[0] - start,
        "stage_mean_s": stage_means,
        "slowest_stage": slowest,
        "scheduler_efficiency": mean_period / stage_means[slowest],
        "wall_s": arrivals[-1] - start,
    }


async def multi(service: Any, single_period: float) -> dict[str, Any]:
    arrivals: dict[str, list[float]] = {}
    media = 0.0
    total = 0
    enough = trio.Event()
    keys = ["d", "a", "w", "l"]
    start = time.perf_counter()
    stalled = False

    async def read(session_id: str) -> None:
        nonlocal media, total
        async with aclosing(service.chunks(session_id)) as chunks:
            async for chunk in chunks:
                arrivals[session_id].append(time.perf_counter())
                media = chunk.media_seconds
                total += 1
                if total >= CHUNKS + SESSIONS:  # 60 chunks after the previews
                    enough.set()

    async def control(session_id: str, key: str) -> None:
        held = Control(ControlType.CONTROL_STATE, keys=frozenset({key}))
        while True:
            await service.push_control(session_id, held)
            await trio.sleep(RESEND_SECONDS)

    async with trio.open_nursery() as nursery:
        ids = []
        for index in range(SESSIONS):
            session_id = await service.create_session(SessionConfig())
            ids.append(session_id)
            arrivals[session_id] = []
            nursery.start_soon(read, session_id)
            nursery.start_soon(control, session_id, keys[index % len(keys)])
        with trio.move_on_after(MULTI_LIMIT_SECONDS) as limit:
            await enough.wait()
        stalled = limit.cancelled_caught
        elapsed = time.perf_counter() - start
        for session_id in ids:
            await service.push_control(session_id, Control(ControlType.STOP))
        nursery.cancel_scope.cancel()
    for session_id in ids:
        await service.close_session(session_id)

    aggregate_period = elapsed / max(total, 1)
    per_session = {}
    for session_id, times in arrivals.items():
        gaps = periods(times[1:])  # after the preview chunk
        max_gap = max(gaps) if gaps else None
        per_session[session_id] = {
            "chunks": len(times),
            "max_gap_s": max_gap,
            "max_gap_single_periods": None if max_gap is None else max_gap / single_period,
            "max_gap_aggregate_periods": None if max_gap is None else max_gap / aggregate_period,
            "max_gap_own_periods": None if max_gap is None else max_gap / statistics.fmean(gaps),
            "real_time_factor": None if len(gaps) < 2 else percentile(sorted(gaps), 0.95) / media,
        }
    worst = [v["max_gap_single_periods"] for v in per_session.values() if v["max_gap_single_periods"] is not None]
    worst_own = [v["max_gap_own_periods"] for v in per_session.values() if v["max_gap_own_periods"] is not None]
    return {
        "bench": "pipeline.multi",
        "sessions": SESSIONS,
        "chunks": total,
        "stalled_at_limit": stalled,
        "wall_s": elapsed,
        "aggregate_chunks_per_s": total / elapsed,
        "chunk_media_seconds": media,
        "single_session_period_s": single_period,
        "worst_max_gap_single_periods": max(worst) if worst else None,
        "worst_max_gap_own_periods": max(worst_own) if worst_own else None,
        "gap_goal_own_periods": 2.0,
        "starved_sessions": sum(1 for v in per_session.values() if v["chunks"] < 2),
        "per_session": per_session,
    }


async def placements() -> dict[str, Any]:
    line: dict[str, Any] = {"bench": "pipeline.placements", "chunks": PLACEMENT_CHUNKS, "size": PLACEMENT_SIZE}
    for name, spec in PLACEMENTS.items():
        start = time.perf_counter()
        service = get_service(placement=spec, **PLACEMENT_SIZE)
        async with service.running():
            started = time.perf_counter() - start
            session_id = await service.create_session(
                SessionConfig(options={"continuous": True, "chunks": PLACEMENT_CHUNKS})
            )
            arrivals: list[float] = []
            media = 0.0
            async with aclosing(service.chunks(session_id)) as chunks:
                async for chunk in chunks:
                    arrivals.append(time.perf_counter())
                    media = chunk.media_seconds
            await service.close_session(session_id)
        gaps = sorted(periods(arrivals[1:]))  # after the first chunk
        line[name] = {
            "real_time_factor": percentile(gaps, 0.95) / media,
            "mean_chunk_period_s": statistics.fmean(gaps),
            "startup_s": started,
        }
    return line


async def resolutions(device: str = "cpu") -> dict[str, Any]:
    line: dict[str, Any] = {"bench": "pipeline.resolutions", "device": device, "chunks": RESOLUTION_CHUNKS}
    service = get_service(device=device)
    walk = Control(ControlType.CONTROL_STATE, keys=frozenset({"w"}))
    async with service.running():
        for resolution in RESOLUTIONS:
            options = {"continuous": True, "chunks": RESOLUTION_CHUNKS + 1, "resolution": resolution}
            session_id = await service.create_session(SessionConfig(options=options))
            await service.push_control(session_id, walk)
            arrivals: list[float] = []
            cpu: list[float] = []
            media = 0.0
            async with aclosing(service.chunks(session_id)) as chunks:
                async for chunk in chunks:
                    arrivals.append(time.perf_counter())
                    cpu.append(time.process_time())
                    media = chunk.media_seconds
            await service.close_session(session_id)
            gaps = sorted(periods(arrivals))  # after the warm-up chunk
            line[resolution] = {
                "real_time_factor": percentile(gaps, 0.95) / media,
                "mean_chunk_period_s": statistics.fmean(gaps),
                "cpu_rtf": (cpu[-1] - cpu[0]) / (len(cpu) - 1) / media,
            }
    base = line[RESOLUTIONS[0]]
    for resolution in RESOLUTIONS[1:]:
        line[resolution]["period_ratio_to_default"] = line[resolution]["mean_chunk_period_s"] / base["mean_chunk_period_s"]
    return line


async def main(only: str | None = None, device: str = "cpu") -> None:
    if only == "placements":
        emit(await placements())
        return
    if only == "resolutions":
        emit(await resolutions(device))
        return
    service = get_service()
    async with service.running():
        line = await single(service)
        emit(line)
    rotating = get_service(rotate_lease=True)
    async with rotating.running():
        emit(await multi(rotating, line["mean_chunk_period_s"]))
    emit(await placements())
    emit(await resolutions())


if __name__ == "__main__":
    args = sys.argv[1:]
    if not (args in ([], ["placements"]) or (args[:1] == ["resolutions"] and len(args) <= 2)):
        print("usage: python -m bench.pipeline [placements | resolutions [DEVICE]]", file=sys.stderr)
        sys.exit(2)
    trio.run(main, *args)
