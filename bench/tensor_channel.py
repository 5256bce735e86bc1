"""WorkerTensorChannel CPU path against an in-process copy, printed as JSON lines.

``python -m bench.tensor_channel`` (optionally ``--sizes 1 8 64``). For each
size (MB of float32) a producer process sends N transfers to a consumer process
through the CPU channel (refs go over a pipe, as the scheduler would forward
them), in two receive modes:

* ``copy``: ``receive(refs, out=dst)`` copies each transfer into a preallocated
  tensor (like the baseline's ``dst``) and acks it at once;
* ``view`` (zero-copy): ``receive(refs, copy=False)`` returns views of the slot,
  then ``release(refs)`` acks it (the consumer drops the view first).

Per mode:

* throughput (``stream``): the producer sends as fast as the two slots allow;
  ``channel_gbps`` (copy) / ``view_gbps`` is bytes / (last receive end -
  first send start);
* latency (``pingpong``): one transfer at a time (the consumer answers before
  the next send); ``channel_ms_p50/p95`` (copy) and ``view_ms_p50/p95`` is send start -> receive end (CLOCK_MONOTONIC
  is shared by the processes), split into ``write`` (the producer's send),
  ``signal`` (send end -> the consumer has the refs) and ``read`` (the
  consumer's receive, plus release for ``view``), medians in ms
  (``channel_split_ms``, ``view_split_ms``).

``fresh``: copy mode allocating a new tensor per transfer (page faults dominate
at 64 MB). Baseline: ``dst.copy_(src)`` of the same tensor in one process,
N times; ``copy_gbps`` is from the median copy (the stricter baseline).
``ratio`` = the best mode's throughput / copy throughput (``mode`` names it;
goal: >= 0.5 at 8 MB and up); ``ratio_copy`` / ``ratio_view`` per mode.
Every process calls ``torch.set_num_threads(1)``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from typing import Any

import torch

from engine.tensor_channel import WorkerTensorChannel

TRANSFERS = {1: 200, 8: 100, 64: 20}
RUNS = (("stream", "copy"), ("stream", "view"), ("pingpong", "copy"), ("pingpong", "view"), ("stream", "fresh"))


def _elements(mb: int) -> int:
    return mb * (1 << 20) // 4


def producer(channel: WorkerTensorChannel, mb: int, n: int, refs_out: Any, acks_in: Any) -> None:
    torch.set_num_threads(1)
    src = torch.randn(_elements(mb))
    for timing, _mode in RUNS:
        for _ in range(n):
            start = time.perf_counter()
            refs = channel.send(src)
            refs_out.send((start, time.perf_counter(), refs))
            if timing == "pingpong":
                acks_in.recv()
    refs_out.send(None)
    channel.detach()
    refs_out.close()
    acks_in.close()


def consumer(channel: WorkerTensorChannel, mb: int, n: int, refs_in: Any, acks_out: Any, results: Any) -> None:
    torch.set_num_threads(1)
    dst = torch.empty(_elements(mb))
    spans: dict[str, list[tuple[float, ...]]] = {}
    for timing, mode in RUNS:
        rows = spans[f"{timing}_{mode}"] = []
        for _ in range(n):
            start, sent, refs = refs_in.recv()
            got = time.perf_counter()
            if mode == "view":
                channel.receive(refs, rank=0, copy=False)  # the view is dropped before the release
                channel.release(refs, rank=0)
            else:
                channel.receive(refs, rank=0, out=None if mode == "fresh" else dst)  # the copy is dropped at once
            rows.append((start, sent, got, time.perf_counter()))
            if timing == "pingpong":
                acks_out.send(True)
    assert refs_in.recv() is None
    channel.detach()
    results.send(spans)
    for conn in (refs_in, acks_out, results):
        conn.close()


def copy_baseline(mb: int, n: int) -> list[float]:
    src = torch.randn(_elements(mb))
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    times = []
    for _ in range(n):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return times


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 3)


def run_size(ctx: Any, mb: int, n: int) -> dict[str, Any]:
    nbytes = mb << 20
    with WorkerTensorChannel(1, timeout=60) as channel:
        refs_in, refs_out = ctx.Pipe(duplex=False)
        acks_in, acks_out = ctx.Pipe(duplex=False)
        results_in, results_out = ctx.Pipe(duplex=False)
        procs = [
            ctx.Process(target=producer, args=(channel, mb, n, refs_out, acks_in)),
            ctx.Process(target=consumer, args=(channel, mb, n, refs_in, acks_out, results_out)),
        ]
        for p in procs:
            p.start()
        for conn in (refs_in, refs_out, acks_in, acks_out, results_out):
            conn.close()
        spans = results_in.recv()
        results_in.close()
        for p in procs:
            p.join()
            p.close()
    copies = copy_baseline(mb, n)
    copy_gbps = nbytes / statistics.median(copies) / 1e9  # the median copy: noise on a shared host is not counted
    row: dict[str, Any] = {"mb": mb, "transfers": n, "copy_ms_p50": _ms(copies), "copy_gbps": round(copy_gbps, 2)}
    for mode in ("copy", "view", "fresh"):
        stream = spans[f"stream_{mode}"]
        gbps = nbytes * n / (stream[-1][3] - stream[0][0]) / 1e9
        name = "channel" if mode == "copy" else mode
        row[f"{name}_gbps"] = round(gbps, 2)
        row[f"ratio_{mode}"] = round(gbps / copy_gbps, 3)
        if mode == "fresh":
            continue
        ping = spans[f"pingpong_{mode}"]
        latency = sorted(end - start for start, _, _, end in ping)
        row[f"{name}_ms_p50"] = _ms(latency)
        row[f"{name}_ms_p95"] = round(latency[min(len(latency) - 1, int(0.95 * len(latency)))] * 1e3, 3)
        row[f"{name}_split_ms"] = {
            "write": _ms([sent - start for start, sent, _, _ in ping]),
            "signal": _ms([got - sent for _, sent, got, _ in ping]),
            "read": _ms([end - got for _, _, got, end in ping]),
        }
    best = max(("copy", "view"), key=lambda m: row[f"ratio_{m}"])
    return {"mb": mb, "mode": best, "ratio": row[f"ratio_{best}"], **row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=list(TRANSFERS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = multiprocessing.get_context("spawn")
    for mb in args.sizes:
        print(json.dumps(run_size(ctx, mb, TRANSFERS.get(mb, 50))), flush=True)


if __name__ == "__main__":
    main()
