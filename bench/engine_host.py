"""What this host's threads cost, for ``python -m bench.engine host``: the bounds under the engine goals.

No scheduler runs here. Each figure is a bare CPython primitive that any scheduler of the engine
workloads pays on a chunk's critical path, measured the way the workloads use it (a stage thread
blocked on its queue for milliseconds before it is handed work, the trio thread asleep in its
loop before a thread hands it a result), and the bounds follow from them:

- ``w3_efficiency_bound``: denoise runs back to back on its thread, so a period is at least its
  8 ms ``time.sleep`` plus that sleep's own overshoot on this host.
- ``w5_latency_bound_ms``: control to output is at least denoise's and decode's sleeps with their
  overshoots, one thread-to-thread hop (denoise's thread hands decode's thread the latent) and one
  thread-to-trio hop (decode's thread hands the output to the reader).
- ``w1_floor_ratio_bound``: a scheduler driven by trio tasks (as the workloads' driver is) cannot
  beat the trio floor: the w1 pipeline with no scheduler at all, fed and read by two trio tasks.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Sequence

import trio

__all__ = ["host_figures"]

IDLE_S = 0.002  # how long the receiving thread sits blocked before each hand-off (as a stage between chunks)


def _pct(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def _on_thread(fn: Callable[[], list[float]]) -> list[float]:
    """Run ``fn`` on a fresh thread (stage handlers never run on the main thread)."""
    box: list[list[float]] = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    thread.join()
    return box[0]


def sleep_overshoot_us(cost: float, samples: int = 60) -> list[float]:
    """How much longer than ``cost`` a ``time.sleep(cost)`` takes on a thread, in us."""

    def measure() -> list[float]:
        spans = []
        for _ in range(samples):
            start = time.perf_counter()
            time.sleep(cost)
            spans.append((time.perf_counter() - start - cost) * 1e6)
        return spans

    return _on_thread(measure)


def thread_hop_us(samples: int = 300) -> list[float]:
    """One hand-off to a thread blocked on a ``queue.SimpleQueue``: put until that thread runs, in us."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    woke: queue.SimpleQueue = queue.SimpleQueue()

    def receiver() -> None:
        while (sent := inbox.get()) is not None:
            woke.put(time.perf_counter() - sent)

    thread = threading.Thread(target=receiver)
    thread.start()
    hops = []
    for _ in range(samples):
        time.sleep(IDLE_S)
        inbox.put(time.perf_counter())
        hops.append(woke.get() * 1e6)
    inbox.put(None)
    thread.join()
    return hops


def trio_hop_us(samples: int = 300) -> list[float]:
    """One hand-off from a thread to a trio task waiting in an idle trio loop, in us."""

    async def main() -> list[float]:
        token = trio.lowlevel.current_trio_token()
        lot = trio.lowlevel.ParkingLot()
        sent: list[float] = []
        go: queue.SimpleQueue = queue.SimpleQueue()

        def sender() -> None:
            while go.get() is not None:
                time.sleep(IDLE_S)
                sent.append(time.perf_counter())
                token.run_sync_soon(lot.unpark_all)

        thread = threading.Thread(target=sender)
        thread.start()
        hops = []
        for _ in range(samples):
            go.put(True)
            await lot.park()
            hops.append((time.perf_counter() - sent[-1]) * 1e6)
        go.put(None)
        thread.join()
        return hops

    return trio.run(main)


def trio_floor_us_per_chunk(chunks: int = 3000) -> float:
    """The w1 floor (three pass-through threads, at most two chunks in flight) fed and read by trio tasks."""

    async def main() -> float:
        token = trio.lowlevel.current_trio_token()
        queues = [queue.SimpleQueue() for _ in range(3)]
        done: collections.deque[int] = collections.deque()
        emitted, room = trio.lowlevel.ParkingLot(), trio.lowlevel.ParkingLot()
        in_flight = 0

        def deliver(item: int) -> None:
            done.append(item)
            emitted.unpark_all()

        def stage(index: int) -> None:
            inbox = queues[index]
            while (item := inbox.get()) is not None:
                if index < 2:
                    queues[index + 1].put(item)
                else:
                    token.run_sync_soon(deliver, item)

        threads = [threading.Thread(target=stage, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        start = time.perf_counter()

        async def push() -> None:
            nonlocal in_flight
            for k in range(chunks):
                while in_flight >= 2:
                    await room.park()
                queues[0].put(k)
                in_flight += 1
                await trio.lowlevel.checkpoint()

        async def read() -> None:
            nonlocal in_flight
            for _ in range(chunks):
                while not done:
                    await emitted.park()
                done.popleft()
                in_flight -= 1
                room.unpark_all()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(push)
            nursery.start_soon(read)
        wall = time.perf_counter() - start
        for inbox in queues:
            inbox.put(None)
        for thread in threads:
            thread.join()
        return wall / chunks * 1e6

    return trio.run(main)


def host_figures(floor_us: float) -> dict:
    """The primitives (p50, and p95 where a tail matters) and the bounds they put under the goals."""
    over8, over4 = sleep_overshoot_us(0.008), sleep_overshoot_us(0.004)
    thread_hops, trio_hops = thread_hop_us(), trio_hop_us()
    trio_floor = trio_floor_us_per_chunk()

    def bound(fraction: float) -> float:
        return 12.0 + (_pct(over8, fraction) + _pct(over4, fraction) + _pct(thread_hops, fraction) + _pct(trio_hops, fraction)) / 1e3

    return {
        "workload": "host",
        "sleep_8ms_overshoot_us": {"p50": _pct(over8, 0.5), "p95": _pct(over8, 0.95)},
        "sleep_4ms_overshoot_us": {"p50": _pct(over4, 0.5), "p95": _pct(over4, 0.95)},
        "thread_hop_us": {"p50": _pct(thread_hops, 0.5), "p95": _pct(thread_hops, 0.95)},
        "thread_to_trio_hop_us": {"p50": _pct(trio_hops, 0.5), "p95": _pct(trio_hops, 0.95)},
        "floor_us_per_chunk": floor_us,
        "trio_floor_us_per_chunk": trio_floor,
        "w1_floor_ratio_bound": floor_us / trio_floor,
        "w3_efficiency_bound": 8.0 / (8.0 + _pct(over8, 0.5) / 1e3),
        "w5_latency_bound_ms": {"p50": bound(0.5), "p95": bound(0.95)},
        "goals": {"w1_floor_ratio": 0.25, "w3_efficiency": 0.98, "w5_latency_p50_ms": 12.3, "w5_latency_p95_ms": 12.6},
    }
