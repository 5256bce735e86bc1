"""What this host's threads cost, for ``python -m bench.engine host``: the bounds under the engine goals.

No scheduler runs here. Each figure is a bare CPython primitive that any scheduler of the engine
workloads pays on a chunk's critical path, measured the way the workloads use it (a stage thread
blocked on its queue for milliseconds before it is handed work, the trio thread asleep in its
loop before a thread hands it a result), and the bounds follow from them:

- ``w3_efficiency_bound``: denoise runs back to back on its thread, so a period is at least its
  8 ms ``time.sleep`` plus that sleep's own overshoot on this host. The sleeps are timed on threads
  with the stage threads' timer slack (``engine.timer_slack``), as chunkline's handlers run;
  ``sleep_8ms_overshoot_default_slack_us`` is the same sleep with the host's default slack, as the
  peer's threads (and any thread that does not ask) have it.
- ``reference_python_us``: a fixed ~1,500 bytecodes of plain Python timed back to back and right after
  an 8 ms sleep on a thread (``slowdown`` the ratio): the pace of a stage thread's scheduling work right
  after its call. ``w3_efficiency_bound_with_one_completion`` adds that much work, at that pace, to
  each denoise period.
- ``wake_cost_to_waker_us``: what the handing thread itself pays to wake a blocked thread (``thread_put``:
  the ``SimpleQueue.put``) or an idle trio loop (``trio_post``: the ``run_sync_soon``), a system call
  that interrupts the other virtual CPU. Between two calls denoise's thread must wake decode's thread
  (the latent is ready) and the caller that pushes the next chunk (its call freed that room);
  ``w3_efficiency_bound_with_completion_and_wakes`` adds both to the bound with one completion.
- ``w5_latency_bound_ms``: control to output is at least denoise's and decode's sleeps with their
  overshoots, one thread-to-thread hop (denoise's thread hands decode's thread the latent) and one
  thread-to-trio hop (decode's thread hands the output to the reader, a trio task in chunkline);
  ``w5_latency_bound_thread_reader_ms`` is the same with a thread for a reader (as the peer's).
- ``w1_trio_floor_us``: w1's floor (three threads, no-op handlers, at most two chunks in flight) with a
  trio task for the driver and one for the reader, as chunkline's callers are: the driver hands chunk k
  to the first thread, the last thread hands it back through ``run_sync_soon`` (one trio wake-up for
  every batch, as chunkline's inbox does). ``floor_ratio_bound`` = the thread floor over it: the best
  ``floor_ratio`` a scheduler with trio callers can show here, with no bookkeeping at all.
- ``w5_no_scheduler_ms``: w5 itself, end to end, with no scheduler: the three stage threads (stage timer slack)
  linked by ``SimpleQueue``s, images handed ahead, control k handed at t0 + k x 20 ms by a trio task, and the
  frames handed back to a trio reader through ``run_sync_soon`` (one wake-up a batch): control to output as the
  workload measures it. What is left of a goal over it is all a scheduler may spend on a chunk's critical path.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import trio

from engine.timer_slack import STAGE_TIMER_SLACK_NS, set_thread_timer_slack

__all__ = ["host_figures"]

IDLE_S = 0.002  # how long the receiving thread sits blocked before each hand-off (as a stage between chunks)


def _pct(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def _on_thread(fn: Callable[[], list[float]], timer_slack_ns: int | None = None) -> list[float]:
    """Run ``fn`` on a fresh thread (stage handlers never run on the main thread), with that timer slack."""
    box: list[list[float]] = []

    def run() -> None:
        if timer_slack_ns is not None:
            set_thread_timer_slack(timer_slack_ns)
        box.append(fn())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return box[0]


def sleep_overshoot_us(cost: float, samples: int = 60, timer_slack_ns: int | None = STAGE_TIMER_SLACK_NS) -> list[float]:
    """How much longer than ``cost`` a ``time.sleep(cost)`` takes on a thread, in us.

    On a thread with the stage threads' timer slack by default; ``None`` keeps the slack a new thread
    inherits (the host's default, 50 us on Linux), as the peer's threads have it.
    """

    def measure() -> list[float]:
        spans = []
        for _ in range(samples):
            start = time.perf_counter()
            time.sleep(cost)
            spans.append((time.perf_counter() - start - cost) * 1e6)
        return spans

    return _on_thread(measure, timer_slack_ns)


def thread_hop_us(samples: int = 300) -> tuple[list[float], list[float]]:
    """One hand-off to a thread blocked on a ``queue.SimpleQueue``, in us: put until that thread runs, and the put itself.

    The put is what the handing thread pays before it can go on (its next call): waking a
    blocked thread is a system call, which in a VM sends an interrupt to the other virtual CPU.
    """
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    woke: queue.SimpleQueue = queue.SimpleQueue()

    def receiver() -> None:
        while (sent := inbox.get()) is not None:
            woke.put(time.perf_counter() - sent)

    thread = threading.Thread(target=receiver)
    thread.start()
    hops, puts = [], []
    for _ in range(samples):
        time.sleep(IDLE_S)
        sent = time.perf_counter()
        inbox.put(sent)
        puts.append((time.perf_counter() - sent) * 1e6)
        hops.append(woke.get() * 1e6)
    inbox.put(None)
    thread.join()
    return hops, puts


REFERENCE_ROUNDS = 100  # about 1,500 bytecodes: one chunk's completion and the admissions it makes, in chunkline


def _reference_python() -> int:
    """A fixed piece of plain Python (dict stores and reads, arithmetic), about 1,500 bytecodes."""
    table: dict[int, int] = {}
    total = 0
    for i in range(REFERENCE_ROUNDS):
        table[i] = i
        total += table.get(i, 0)
    return total


def python_after_sleep_us(samples: int = 60) -> dict[str, list[float]]:
    """The reference Python timed back to back and right after an 8 ms ``time.sleep``, on a thread, in us.

    A stage's thread does its scheduling work right after its handler's call (a sleep here, an
    accelerator wait in a model) returns; on this host Python runs several times slower then than
    back to back (caches and the virtual CPU's state after an idle spell), which no scheduler avoids.
    """

    def measure(idle_s: float) -> list[float]:
        spans = []
        for _ in range(samples):
            if idle_s:
                time.sleep(idle_s)
            start = time.perf_counter()
            _reference_python()
            spans.append((time.perf_counter() - start) * 1e6)
        return spans

    return {"back_to_back": _on_thread(lambda: measure(0.0)), "after_8ms_sleep": _on_thread(lambda: measure(0.008))}


def trio_hop_us(samples: int = 300) -> tuple[list[float], list[float]]:
    """One hand-off from a thread to a trio task waiting in an idle trio loop, in us: until it runs, and the post itself."""

    async def main() -> list[float]:
        token = trio.lowlevel.current_trio_token()
        lot = trio.lowlevel.ParkingLot()
        sent: list[float] = []
        posts: list[float] = []
        go: queue.SimpleQueue = queue.SimpleQueue()

        def sender() -> None:
            while go.get() is not None:
                time.sleep(IDLE_S)
                sent.append(time.perf_counter())
                token.run_sync_soon(lot.unpark_all)
                posts.append((time.perf_counter() - sent[-1]) * 1e6)

        thread = threading.Thread(target=sender)
        thread.start()
        hops = []
        for _ in range(samples):
            go.put(True)
            await lot.park()
            hops.append((time.perf_counter() - sent[-1]) * 1e6)
        go.put(None)
        thread.join()
        return hops, posts

    return trio.run(main)


def w1_trio_floor_us(chunks: int = 3000) -> float:
    """w1 with no scheduler: a trio driver and reader around three SimpleQueue-linked threads, in us a chunk."""

    async def main() -> float:
        token = trio.lowlevel.current_trio_token()
        first, second, third = queue.SimpleQueue(), queue.SimpleQueue(), queue.SimpleQueue()
        lock = threading.Lock()
        arrived: list[int] = []  # chunks the last thread finished, for the trio thread to take
        done: list[int] = []
        room, ready = trio.lowlevel.ParkingLot(), trio.lowlevel.ParkingLot()
        in_flight = 0

        def take_batch() -> None:
            nonlocal in_flight
            with lock:
                done.extend(arrived)
                in_flight -= len(arrived)
                arrived.clear()
            room.unpark_all()
            ready.unpark_all()

        def relay(inbox: queue.SimpleQueue, outbox: queue.SimpleQueue) -> None:
            while (item := inbox.get()) is not None:
                outbox.put(item)
            outbox.put(None)

        def hand_back() -> None:
            while (item := third.get()) is not None:
                with lock:
                    arrived.append(item)
                    first_of_batch = len(arrived) == 1
                if first_of_batch:
                    token.run_sync_soon(take_batch)

        threads = [threading.Thread(target=relay, args=(first, second)),
                   threading.Thread(target=relay, args=(second, third)), threading.Thread(target=hand_back)]
        for thread in threads:
            thread.start()

        async def drive() -> None:
            nonlocal in_flight
            for k in range(chunks):
                while in_flight >= 2:
                    await room.park()
                in_flight += 1
                first.put(k)

        async def read() -> None:
            taken = 0
            while taken < chunks:
                if not done:
                    await ready.park()
                taken += len(done)
                done.clear()

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drive)
            nursery.start_soon(read)
        wall = time.perf_counter() - start
        first.put(None)
        for thread in threads:
            thread.join()
        return wall / chunks * 1e6

    return trio.run(main)


W5_CHUNKS = 100
W5_PACING_S = 0.020
W5_COSTS_S = (0.002, 0.008, 0.004)  # encode, denoise, decode


def w5_no_scheduler_ms(chunks: int = W5_CHUNKS) -> list[float]:
    """w5 with no scheduler: control-to-output latencies in ms (a trio pacer and reader, three linked threads)."""

    async def main() -> list[float]:
        token = trio.lowlevel.current_trio_token()
        images, conditions, controls, latents = (queue.SimpleQueue() for _ in range(4))
        lock = threading.Lock()
        arrived: list[int] = []  # chunks decode finished, for the reader to take
        ready = trio.lowlevel.ParkingLot()
        control_at: dict[int, float] = {}
        latencies: list[float] = []

        def stage(cost: float, inputs: tuple[queue.SimpleQueue, ...], hand_on: Callable[[int], None]) -> None:
            set_thread_timer_slack(STAGE_TIMER_SLACK_NS)
            for _ in range(chunks):
                for inbox in inputs:
                    k = inbox.get()
                time.sleep(cost)
                hand_on(k)

        def hand_back(k: int) -> None:
            with lock:
                arrived.append(k)
                first_of_batch = len(arrived) == 1
            if first_of_batch:
                token.run_sync_soon(ready.unpark_all)

        encode, denoise, decode = W5_COSTS_S
        threads = [
            threading.Thread(target=stage, args=(encode, (images,), conditions.put)),
            threading.Thread(target=stage, args=(denoise, (conditions, controls), latents.put)),
            threading.Thread(target=stage, args=(decode, (latents,), hand_back)),
        ]
        for thread in threads:
            thread.start()
        for k in range(chunks):
            images.put(k)
        start = trio.current_time()

        async def pace_controls() -> None:
            for k in range(chunks):
                await trio.sleep_until(start + k * W5_PACING_S)
                controls.put(k)
                control_at[k] = time.perf_counter()

        async def read() -> None:
            while len(latencies) < chunks:
                with lock:
                    batch = arrived[:]
                    arrived.clear()
                if not batch:
                    await ready.park()
                    continue
                now = time.perf_counter()
                latencies.extend((now - control_at[k]) * 1e3 for k in batch)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pace_controls)
            nursery.start_soon(read)
        for thread in threads:
            thread.join()
        return latencies

    return trio.run(main)


def host_figures(thread_floor_us: float | None = None) -> dict:
    """The primitives (p50, and p95 where a tail matters) and the bounds they put under the goals."""
    over8, over4 = sleep_overshoot_us(0.008), sleep_overshoot_us(0.004)
    over8_default_slack = sleep_overshoot_us(0.008, timer_slack_ns=None)
    (thread_hops, thread_puts), (trio_hops, trio_posts) = thread_hop_us(), trio_hop_us()
    wakes_us = _pct(thread_puts, 0.5) + _pct(trio_posts, 0.5)

    def bound(fraction: float, reader_hops: list[float]) -> float:
        sleeps = _pct(over8, fraction) + _pct(over4, fraction)
        return 12.0 + (sleeps + _pct(thread_hops, fraction) + _pct(reader_hops, fraction)) / 1e3

    trio_floor = w1_trio_floor_us()
    bare_w5 = w5_no_scheduler_ms()
    python = python_after_sleep_us()
    cold, hot = _pct(python["after_8ms_sleep"], 0.5), _pct(python["back_to_back"], 0.5)
    figures = {
        "workload": "host",
        "sleep_8ms_overshoot_us": {"p50": _pct(over8, 0.5), "p95": _pct(over8, 0.95)},
        "sleep_4ms_overshoot_us": {"p50": _pct(over4, 0.5), "p95": _pct(over4, 0.95)},
        "sleep_8ms_overshoot_default_slack_us": {"p50": _pct(over8_default_slack, 0.5),
                                                 "p95": _pct(over8_default_slack, 0.95)},
        "thread_hop_us": {"p50": _pct(thread_hops, 0.5), "p95": _pct(thread_hops, 0.95)},
        "thread_to_trio_hop_us": {"p50": _pct(trio_hops, 0.5), "p95": _pct(trio_hops, 0.95)},
        "wake_cost_to_waker_us": {"thread_put": _pct(thread_puts, 0.5), "trio_post": _pct(trio_posts, 0.5)},
        "reference_python_us": {"back_to_back": hot, "after_8ms_sleep": cold, "slowdown": cold / hot},
        "w3_efficiency_bound": 8.0 / (8.0 + _pct(over8, 0.5) / 1e3),
        # denoise's thread also runs at least its completion's Python between two calls, at the after-sleep pace
        "w3_efficiency_bound_with_one_completion": 8.0 / (8.0 + (_pct(over8, 0.5) + cold) / 1e3),
        # ... and, before its next call, wakes decode's thread and the caller that pushes the next chunk
        "w3_efficiency_bound_with_completion_and_wakes": 8.0 / (8.0 + (_pct(over8, 0.5) + cold + wakes_us) / 1e3),
        "w5_latency_bound_ms": {"p50": bound(0.5, trio_hops), "p95": bound(0.95, trio_hops)},
        "w5_latency_bound_thread_reader_ms": {"p50": bound(0.5, thread_hops), "p95": bound(0.95, thread_hops)},
        "w5_no_scheduler_ms": {"p50": _pct(bare_w5, 0.5), "p95": _pct(bare_w5, 0.95)},
        "w1_trio_floor_us": trio_floor,
        "goals": {"w3_efficiency": 0.98, "w5_latency_p50_ms": 12.3, "w5_latency_p95_ms": 12.6, "w1_floor_ratio": 0.25},
    }
    if thread_floor_us is not None:
        figures["w1_thread_floor_us"] = thread_floor_us
        figures["floor_ratio_bound"] = thread_floor_us / trio_floor
    return figures
