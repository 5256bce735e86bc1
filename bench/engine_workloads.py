"""The engine workloads of WORKLOADS.md, run on chunkline or on the peer: the graph, the handlers, the driver.

Three stages, one synchronous handler per stage actor (``time.sleep(cost)``), capacity-2 edges, the driver pushing
image and control for chunk k as soon as they are admitted (or control k at t0 + k x pacing). Each run returns its
figures (``run_workload`` on chunkline, ``run_peer`` on the peer through the same handlers); ``bench.engine``
prints them.
"""

from __future__ import annotations

import os
import queue
import resource
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import trio

from engine import EdgeSpec, LocalStageActor, PipelineSpec, StageSpec, open_orchestrator
from engine.threads import TrioInbox

from .engine_peer import run_peer_workload

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


class StageClock:
    """Entry and exit stamps of every handler call, to measure each hop of a chunk's critical path."""

    def __init__(self) -> None:
        self.entered: dict[tuple[str, str, int], float] = {}
        self.exited: dict[tuple[str, str, int], float] = {}

    def handler(self, stage: str, output: str, cost: float) -> Callable:
        entered, exited = self.entered, self.exited

        def handle(invocation):
            key = invocation.key
            entered[(stage, key.session_id, key.sequence_id)] = time.perf_counter()
            if cost > 0:
                time.sleep(cost)
            exited[(stage, key.session_id, key.sequence_id)] = time.perf_counter()
            return {output: key.sequence_id}

        return handle

    def handlers(self, costs: Sequence[float]) -> dict[str, Callable]:
        return {
            "encode": self.handler("encode", "condition", costs[0]),
            "denoise": self.handler("denoise", "latent", costs[1]),
            "decode": self.handler("decode", "frames", costs[2]),
        }

    def hops(self, sessions: int, chunks: int, control_at: list[dict[int, float]], emitted: list[tuple[float, int, int]]) -> dict[str, float]:
        """p50 of each hand-off: from the moment a stage could start a chunk to the moment it did.

        ``->denoise``: its inputs (condition, control) exist and its previous call ended;
        ``->decode``: the latent exists and decode's previous call ended; ``->output``: decode
        ended until the reader holds the frame. Each is one thread wake-up at best.
        """
        entered, exited = self.entered, self.exited
        emitted_at = {(index, seq): t for t, index, seq in emitted}
        gaps: dict[str, list[float]] = {"->denoise": [], "->decode": [], "->output": []}
        for index in range(sessions):
            sid = f"s{index}"
            for k in range(1, chunks):
                try:
                    ready = max(control_at[index][k], exited[("encode", sid, k)], exited[("denoise", sid, k - 1)])
                    gaps["->denoise"].append(entered[("denoise", sid, k)] - ready)
                    ready = max(exited[("denoise", sid, k)], exited[("decode", sid, k - 1)])
                    gaps["->decode"].append(entered[("decode", sid, k)] - ready)
                    gaps["->output"].append(emitted_at[(index, k)] - exited[("decode", sid, k)])
                except KeyError:
                    continue
        hops = {name: _pct(sorted(values), 0.5) * 1e6 for name, values in gaps.items() if values}
        if hops:
            hops["per_hop"] = statistics.fmean(hops.values())
        return hops

    def overshoot_us(self, stage: str, cost: float) -> float | None:
        """p50 of how much longer than its cost a call took (the sleep's own wake-up, not the scheduler's)."""
        spans = sorted(self.exited[k] - self.entered[k] - cost for k in self.exited if k[0] == stage)
        return _pct(spans, 0.5) * 1e6 if spans and cost > 0 else None


async def run_workload(
    sessions: int, chunks: int, costs: Sequence[float], pacing: float | None, spec: PipelineSpec = SPEC
) -> dict:
    clock = StageClock()
    actors = {name: LocalStageActor(handler, name=name) for name, handler in clock.handlers(costs).items()}
    emitted: list[tuple[float, int, int]] = []  # (time, session index, seq)
    control_at: list[dict[int, float]] = [dict() for _ in range(sessions)]
    latencies: list[float] = []
    finish: list[float] = [0.0] * sessions
    async with open_orchestrator(spec, actors) as orch:
        handles = [orch.create_session(f"s{i}", final_sequence_id=chunks - 1) for i in range(sessions)]
        start = time.perf_counter()
        cpu_before = _thread_cpu_s()

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
        cpu_after = _thread_cpu_s()
        for session in handles:
            await session.aclose()
    figures = _figures(clock, sessions, chunks, costs, wall, emitted, control_at, latencies, finish)
    figures["trio_wakeups_per_chunk"] = TrioInbox.current().batches / (sessions * chunks)
    figures["thread_cpu_us_per_chunk"] = {
        name: (cpu_after[name] - cpu_before[name]) / (sessions * chunks) * 1e6
        for name in ("trio", *clock.handlers(costs)) if name in cpu_before and name in cpu_after
    }
    return figures


def _thread_cpu_s() -> dict[str, float]:
    """CPU time (user + system) of each live thread of this process, by name (Linux /proc; else empty)."""
    tick = os.sysconf("SC_CLK_TCK")
    spent = {}
    for thread in threading.enumerate():
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = "trio" if thread is threading.main_thread() else thread.name
        spent[name] = (int(fields[11]) + int(fields[12])) / tick
    return spent


def _blocked_and_woken() -> int:
    """Voluntary context switches of every thread of this process so far (a block, then a wake-up)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def counting_wakeups(chunks: int, run: Callable[[], dict]) -> dict:
    before, cpu_before = _blocked_and_woken(), _process_cpu_s()
    figures = run()
    figures["wakeups_per_chunk"] = (_blocked_and_woken() - before) / chunks
    figures["cpu_us_per_chunk"] = (_process_cpu_s() - cpu_before) / chunks * 1e6
    return figures


def run_peer(peer, sessions: int, chunks: int, costs: Sequence[float], pacing: float | None, depth: int = 2) -> dict:
    clock = StageClock()
    raw = run_peer_workload(peer, sessions, chunks, clock.handlers(costs), pacing, depth)
    control_at = raw.pop("control_at")
    return _figures(clock, sessions, chunks, costs, raw["wall"], raw["emitted"], control_at, raw["latencies"], raw["finish"])


def _figures(clock: StageClock, sessions: int, chunks: int, costs: Sequence[float], wall: float,
             emitted: list, control_at: list, latencies: list[float], finish: list[float]) -> dict:
    total = sessions * chunks
    times = sorted(t for t, _, _ in emitted)
    periods = [b - a for a, b in zip(times, times[1:])]
    latencies = sorted(latencies)
    figures = {
        "wall_s": wall,
        "chunks_per_s": total / wall,
        "us_per_chunk": wall / total * 1e6,
        "mean_period_ms": statistics.fmean(periods) * 1e3 if periods else None,
        "fairness_max_over_min_finish": max(finish) / min(finish) if min(finish) > 0 else None,
        "latency_p50_ms": _pct(latencies, 0.50) * 1e3,
        "latency_p95_ms": _pct(latencies, 0.95) * 1e3,
    }
    if costs[1] > 0:
        if sessions == 1:  # with several sessions a stage also waits for the others' turns: not a hop
            figures["hop_p50_us"] = clock.hops(sessions, chunks, control_at, emitted)
        figures["denoise_sleep_overshoot_us"] = clock.overshoot_us("denoise", costs[1])
    return figures


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
