"""The canonical engine workloads (w1-w5) and the CPython floor, printed as JSON lines.

``python -m bench.engine`` runs all; ``python -m bench.engine w3 w5`` runs those named.
The graph, costs and driver follow the shared WORKLOADS definition exactly: three
stages, one synchronous handler per stage actor (``time.sleep(cost)``), capacity-2
edges, the driver pushing image and control for chunk k as soon as they are admitted.
"""

from __future__ import annotations

import json
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence

import trio

from engine import EdgeSpec, LocalStageActor, PipelineSpec, StageSpec, open_orchestrator

SPEC = PipelineSpec(
    stages=(
        StageSpec("encode", {"image"}, {"condition"}),
        StageSpec("denoise", {"condition", "control"}, {"latent"}),
        StageSpec("decode", {"latent"}, {"frames"}),
    ),
    edges=(
        EdgeSpec("image", "encode", None, 2),
        EdgeSpec("condition", "denoise", "encode", 2),
        EdgeSpec("control", "denoise", None, 2),
        EdgeSpec("latent", "decode", "denoise", 2),
    ),
    output_artifacts={"frames"},
    output_capacity_per_session=2,
    latency_anchor_artifact="control",
)

WORKLOADS = {
    # id: (sessions, chunks, (encode, denoise, decode) seconds, control pacing seconds or None)
    "w1": (1, 3000, (0.0, 0.0, 0.0), None),
    "w2": (8, 400, (0.0, 0.0, 0.0), None),
    "w3": (1, 150, (0.002, 0.008, 0.004), None),
    "w4": (4, 60, (0.002, 0.008, 0.004), None),
    "w5": (1, 100, (0.002, 0.008, 0.004), 0.020),
}
IDEAL_PERIOD_MS = {"w3": 8.0, "w4": 8.0}


def _handler(output: str, cost: float) -> Callable:
    if cost > 0:
        def handle(invocation):
            time.sleep(cost)
            return {output: invocation.key.sequence_id}
    else:
        def handle(invocation):
            return {output: invocation.key.sequence_id}
    return handle


async def _run_workload(sessions: int, chunks: int, costs: Sequence[float], pacing: float | None) -> dict:
    actors = {
        "encode": LocalStageActor(_handler("condition", costs[0]), name="encode"),
        "denoise": LocalStageActor(_handler("latent", costs[1]), name="denoise"),
        "decode": LocalStageActor(_handler("frames", costs[2]), name="decode"),
    }
    emitted: list[tuple[float, int, int]] = []  # (time, session index, seq)
    control_at: list[dict[int, float]] = [dict() for _ in range(sessions)]
    latencies: list[float] = []
    finish: list[float] = [0.0] * sessions
    async with open_orchestrator(SPEC, actors) as orch:
        handles = [orch.create_session(f"s{i}", final_sequence_id=chunks - 1) for i in range(sessions)]
        start = time.perf_counter()

        async def drive(index: int) -> None:
            session = handles[index]
            if pacing is None:
                for k in range(chunks):
                    await session.push(k, {"image": k, "control": k})
                    control_at[index][k] = time.perf_counter()
            else:
                async def images() -> None:
                    for k in range(chunks):
                        await session.push(k, {"image": k})

                async def controls() -> None:
                    for k in range(chunks):
                        await trio.sleep_until(trio_start + k * pacing)
                        await session.push(k, {"control": k})
                        control_at[index][k] = time.perf_counter()

                async with trio.open_nursery() as inner:
                    inner.start_soon(images)
                    inner.start_soon(controls)

        async def consume(index: int) -> None:
            async for seq, _ in handles[index].outputs():
                now = time.perf_counter()
                emitted.append((now, index, seq))
                latencies.append(now - control_at[index][seq])
            finish[index] = time.perf_counter() - start

        trio_start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(sessions):
                nursery.start_soon(drive, i)
                nursery.start_soon(consume, i)
        wall = time.perf_counter() - start
        for session in handles:
            await session.aclose()
    total = sessions * chunks
    times = sorted(t for t, _, _ in emitted)
    periods = [b - a for a, b in zip(times, times[1:])]
    latencies.sort()
    return {
        "wall_s": wall,
        "chunks_per_s": total / wall,
        "us_per_chunk": wall / total * 1e6,
        "mean_period_ms": statistics.fmean(periods) * 1e3 if periods else None,
        "fairness_max_over_min_finish": max(finish) / min(finish) if min(finish) > 0 else None,
        "latency_p50_ms": _pct(latencies, 0.50) * 1e3,
        "latency_p95_ms": _pct(latencies, 0.95) * 1e3,
    }


def _pct(ordered: Sequence[float], fraction: float) -> float:
    position = (len(ordered) - 1) * fraction
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def floor_us_per_chunk(chunks: int = 3000) -> float:
    """Three threads with no-op handlers, SimpleQueue hand-offs, at most two chunks in flight."""
    q1: queue.SimpleQueue = queue.SimpleQueue()
    q2: queue.SimpleQueue = queue.SimpleQueue()
    q3: queue.SimpleQueue = queue.SimpleQueue()
    out: queue.SimpleQueue = queue.SimpleQueue()

    def stage(inbox: queue.SimpleQueue, outbox: queue.SimpleQueue) -> None:
        while True:
            item = inbox.get()
            if item is None:
                outbox.put(None)
                return
            outbox.put(item)

    threads = [
        threading.Thread(target=stage, args=(q1, q2)),
        threading.Thread(target=stage, args=(q2, q3)),
        threading.Thread(target=stage, args=(q3, out)),
    ]
    for t in threads:
        t.start()
    start = time.perf_counter()
    in_flight = 0
    sent = 0
    received = 0
    while received < chunks:
        while sent < chunks and in_flight < 2:
            q1.put(sent)
            sent += 1
            in_flight += 1
        out.get()
        received += 1
        in_flight -= 1
    wall = time.perf_counter() - start
    q1.put(None)
    for t in threads:
        t.join()
    return wall / chunks * 1e6


def run(names: Sequence[str]) -> list[dict]:
    results = []
    floor = floor_us_per_chunk() if "w1" in names else None
    for name in names:
        sessions, chunks, costs, pacing = WORKLOADS[name]
        figures = trio.run(_run_workload, sessions, chunks, costs, pacing)
        line = {"workload": name, "sessions": sessions, "chunks": chunks, **figures}
        if name in IDEAL_PERIOD_MS:
            line["ideal_period_ms"] = IDEAL_PERIOD_MS[name]
            line["efficiency"] = IDEAL_PERIOD_MS[name] / figures["mean_period_ms"]
        if name == "w1":
            line["floor_us_per_chunk"] = floor
            line["floor_ratio"] = floor / figures["us_per_chunk"]
        results.append(line)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in line.items()}), flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    names = list(argv if argv is not None else sys.argv[1:]) or list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        print(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}", file=sys.stderr)
        return 2
    run(names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
