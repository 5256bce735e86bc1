"""Workloads again in alternated rounds, chunkline then the peer: medians that keep the host's drift out of ratios.

``w1_rounds`` (with the CPython floor), ``w1_one_core`` and ``w1_deep`` re-run w1; ``w3_one_core`` and
``w5_one_core`` re-run the paced workloads with every thread of each run on one CPU. None is a WORKLOADS.md
workload: they are diagnostics that say how much of a figure is the scheduler and how much the host.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Iterator
from typing import Any

import attrs
import trio

from engine import EdgeSpec, PipelineSpec

from .engine_workloads import IDEAL_PERIOD_MS, SPEC, WORKLOADS, floor_us_per_chunk, run_peer, run_workload

ROUNDS = {"w1_rounds": 5, "w1_one_core": 3, "w1_deep": 3, "w3_one_core": 3, "w5_one_core": 3}
DEEP = 8  # w1_deep: how many items every edge and the output buffer hold


def deep_spec(depth: int) -> PipelineSpec:
    """The workloads' graph with every edge and the output buffer ``depth`` items deep (``w1_deep``, not a workload)."""
    edges = tuple(EdgeSpec(e.artifact, e.target_stage, e.source_stage, depth) for e in SPEC.edges)
    return attrs.evolve(SPEC, edges=edges, output_capacity_per_session=depth)


def w1_rounds(peer: Any = None, *, one_cpu: bool = False, depth: int = 2) -> dict:
    """w1 again in alternated rounds, chunkline then the peer (and the floor), reported by their medians.

    A single w1 run lasts under a second and moves by a third from run to run on a shared two-core
    host; alternating the two schedulers and taking medians keeps a drift of the host out of the
    ratio (``w1_rounds``, with the floor of every round for ``floor_ratio``). ``one_cpu`` runs every
    thread on one CPU (``w1_one_core``): on two cores each thread hand-off can be a wake-up across
    cores (in a VM, an interrupt between virtual CPUs); on one core the hand-offs stay and only what
    a scheduler runs per chunk is left, so the ratio measures the schedulers' own cost with far less
    of the host's noise. ``depth`` (``w1_deep``, not a WORKLOADS.md workload) makes every edge and the
    output buffer that deep: with two-deep edges each pair of chunks waits on the reader's trio wake-up
    and on hand-offs across cores; deep enough, the threads run on without waiting, and what is left is
    each scheduler's work per chunk at the pace of two cores.
    """
    name = "w1_one_core" if one_cpu else "w1_deep" if depth != 2 else "w1_rounds"
    spec = SPEC if depth == 2 else deep_spec(depth)
    sessions, chunks, costs, pacing = WORKLOADS["w1"]
    cpu = min(os.sched_getaffinity(0))
    runs: dict[str, list[float]] = {"chunkline": []}
    if peer is not None:
        runs["peer"] = []
    if name == "w1_rounds":
        runs["floor"] = []
    for _ in range(ROUNDS[name]):
        with on_one_cpu(cpu) if one_cpu else contextlib.nullcontext():  # a run's threads inherit the CPU set
            runs["chunkline"].append(trio.run(run_workload, sessions, chunks, costs, pacing, spec)["us_per_chunk"])
            if peer is not None:
                runs["peer"].append(run_peer(peer, sessions, chunks, costs, pacing, depth)["us_per_chunk"])
            if name == "w1_rounds":
                runs["floor"].append(floor_us_per_chunk(chunks))
    line: dict[str, Any] = {"workload": name, "rounds": ROUNDS[name]}
    if one_cpu:
        line["cpu"] = cpu
    if depth != 2:
        line["depth"] = depth
    medians = {impl: statistics.median(values) for impl, values in runs.items()}
    for impl, values in runs.items():
        line[f"{impl}_us_per_chunk"] = {"min": min(values), "median": medians[impl]}
    if peer is not None:
        line["chunkline_over_peer_chunks_per_s"] = medians["peer"] / medians["chunkline"]
    if "floor" in medians:
        line["floor_ratio"] = medians["floor"] / medians["chunkline"]
    return line


@contextlib.contextmanager
def on_one_cpu(cpu: int) -> Iterator[None]:
    """Pin the calling thread (and the threads it starts) to one CPU; restore its CPU set after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


PACED_FIGURES = ("latency_p50_ms", "latency_p95_ms", "per_hop_us", "efficiency")


def paced_one_core(name: str, peer: Any = None) -> dict:
    """A paced workload (w3, w5) in alternated rounds, on every CPU and with every thread on one CPU.

    The stages sleep, so the GIL and one core carry a chunk's Python; what a second core changes is that each
    hand-off between threads can be a wake-up across CPUs (in a VM, an interrupt between virtual CPUs, and a
    thread that starts on a CPU that was idle). Each round runs chunkline and the peer both ways, so the medians
    say what the host's hand-offs across CPUs add to each scheduler's latency and period, from the same rounds.
    """
    line_name = f"{name}_one_core"
    sessions, chunks, costs, pacing = WORKLOADS[name]
    cpu = min(os.sched_getaffinity(0))
    impls = {"chunkline": lambda: trio.run(run_workload, sessions, chunks, costs, pacing)}
    if peer is not None:
        impls["peer"] = lambda: run_peer(peer, sessions, chunks, costs, pacing)
    runs: dict[str, list[dict]] = {f"{impl}_{cpus}": [] for impl in impls for cpus in ("all_cpus", "one_cpu")}
    for _ in range(ROUNDS[line_name]):
        for impl, run_once in impls.items():
            runs[f"{impl}_all_cpus"].append(run_once())
            with on_one_cpu(cpu):  # a run's threads inherit the CPU set
                runs[f"{impl}_one_cpu"].append(run_once())
    line: dict[str, Any] = {"workload": line_name, "rounds": ROUNDS[line_name], "cpu": cpu}
    wanted = [f for f in PACED_FIGURES if f != "efficiency" or name in IDEAL_PERIOD_MS]
    for key, figures in runs.items():
        line[key] = {figure: statistics.median(_paced_figure(name, f, figure) for f in figures) for figure in wanted}
    return line


def _paced_figure(workload: str, figures: dict, figure: str) -> float:
    if figure == "per_hop_us":
        return figures["hop_p50_us"]["per_hop"]
    if figure == "efficiency":
        return IDEAL_PERIOD_MS[workload] / figures["mean_period_ms"]
    return figures[figure]
