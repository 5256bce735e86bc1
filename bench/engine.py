"""The canonical engine workloads (w1-w5) and the CPython floor, printed as JSON lines.

``python -m bench.engine`` runs all; ``python -m bench.engine w3 w5`` runs those named;
``--peer PATH`` also runs the peer scheduler (see ``bench/engine_peer.py``) on each workload in
the same run and prints the ratios. Lines with a stage cost carry ``hop_p50_us``: how long each
hand-off of a chunk's critical path took (a stage able to start until it started). Every line
carries ``wakeups_per_chunk``: how often a thread of the process blocked and was woken again
(voluntary context switches), per chunk, and ``cpu_us_per_chunk``: the process's CPU time (user +
system) per chunk; chunkline's also ``trio_wakeups_per_chunk``: how often a stage's thread had to
wake the trio thread, and ``thread_cpu_us_per_chunk``: that CPU time split by thread (the trio
thread, each stage's), which says where a chunk's cost goes. ``python -m bench.engine host`` (part of the
default run) prints what this host's bare thread primitives cost and the bounds they put under
the goals (``bench/engine_host.py``). After the workloads come diagnostics in alternated rounds
(``bench/engine_rounds.py``): w1 again (``w1_rounds``, ``w1_one_core``, ``w1_deep``), and w3 and w5 each on
every CPU and with every thread on one CPU (``w3_one_core``, ``w5_one_core``), for chunkline and the peer.
The graph, costs and driver follow the shared WORKLOADS definition exactly (``bench/engine_workloads.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import trio

from .engine_host import host_figures
from .engine_peer import load_peer
from .engine_rounds import DEEP, paced_one_core, w1_rounds
from .engine_work import COUNTED_CHUNKS, bytecodes_per_chunk
from .engine_workloads import IDEAL_PERIOD_MS, WORKLOADS, StageClock, counting_wakeups, floor_us_per_chunk, run_peer, run_workload


def _line(name: str, impl: str, figures: dict, floor: float | None) -> dict:
    sessions, chunks, _costs, _pacing = WORKLOADS[name]
    line = {"workload": name, "impl": impl, "sessions": sessions, "chunks": chunks, **figures}
    if name in IDEAL_PERIOD_MS:
        line["ideal_period_ms"] = IDEAL_PERIOD_MS[name]
        line["efficiency"] = IDEAL_PERIOD_MS[name] / figures["mean_period_ms"]
    if name == "w1" and floor is not None:
        line["floor_us_per_chunk"] = floor
        line["floor_ratio"] = floor / figures["us_per_chunk"]
    return line


def _print(line: dict) -> None:
    def rounded(value):
        if isinstance(value, float):
            return round(value, 4)
        if isinstance(value, dict):
            return {k: rounded(v) for k, v in value.items()}
        return value

    print(json.dumps({k: rounded(v) for k, v in line.items()}), flush=True)


def run(names: Sequence[str], peer_path: str | None = None) -> list[dict]:
    """Each workload on chunkline, then (with a peer) on the peer, then their ratios: all in one run."""
    peer = load_peer(peer_path) if peer_path else None
    results = []
    floor = floor_us_per_chunk() if {"w1", "host"} & set(names) else None
    for name in names:
        if name == "host":
            results.append(host_figures(floor))
            _print(results[-1])
            continue
        sessions, chunks, costs, pacing = WORKLOADS[name]
        ours = _line(name, "chunkline", counting_wakeups(
            sessions * chunks, functools.partial(trio.run, run_workload, sessions, chunks, costs, pacing)), floor)
        results.append(ours)
        _print(ours)
        if peer is None:
            continue
        theirs = _line(name, "peer", counting_wakeups(
            sessions * chunks, functools.partial(run_peer, peer, sessions, chunks, costs, pacing)), floor)
        results.append(theirs)
        _print(theirs)
        _print({
            "workload": name,
            "chunkline_over_peer_chunks_per_s": ours["chunks_per_s"] / theirs["chunks_per_s"],
            "chunkline_minus_peer_latency_p50_ms": ours["latency_p50_ms"] - theirs["latency_p50_ms"],
            "chunkline_minus_peer_latency_p95_ms": ours["latency_p95_ms"] - theirs["latency_p95_ms"],
        })
    if "w1" in names:
        results.append(w1_work(peer))
        _print(results[-1])
        results.append(w1_rounds(peer))
        _print(results[-1])
        results.append(w1_rounds(peer, one_cpu=True))
        _print(results[-1])
        results.append(w1_rounds(peer, depth=DEEP))
        _print(results[-1])
    for name in ("w3", "w5"):
        if name in names:
            results.append(paced_one_core(name, peer))
            _print(results[-1])
    return results


def w1_work(peer: Any = None) -> dict:
    """w1's Python work per chunk (bytecodes, every thread), for chunkline and the peer: noise-free figures."""
    sessions, _chunks, costs, pacing = WORKLOADS["w1"]
    stages = frozenset(StageClock().handlers(costs))
    line: dict[str, Any] = {"workload": "w1", "counted_chunks": COUNTED_CHUNKS, "bytecodes_per_chunk": {}}
    counted = line["bytecodes_per_chunk"]
    counted["chunkline"] = bytecodes_per_chunk(
        functools.partial(trio.run, run_workload, sessions, COUNTED_CHUNKS, costs, pacing), COUNTED_CHUNKS, stages)
    if peer is not None:
        counted["peer"] = bytecodes_per_chunk(
            functools.partial(run_peer, peer, sessions, COUNTED_CHUNKS, costs, pacing), COUNTED_CHUNKS)
        line["chunkline_over_peer_bytecodes"] = counted["chunkline"]["total"] / counted["peer"]["total"]
    return line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="*", help=f"some of {[*WORKLOADS, 'host']} (default: all)")
    parser.add_argument(
        "--peer", default=os.environ.get("CHUNKLINE_PEER_ORCHESTRATOR"),
        help="the peer's streaming_pipeline_orchestrator.py, run on the same workloads in the same run "
             "(default: $CHUNKLINE_PEER_ORCHESTRATOR)",
    )
    args = parser.parse_args(argv)
    names = args.workloads or [*WORKLOADS, "host"]
    unknown = [n for n in names if n not in WORKLOADS and n != "host"]
    if unknown:
        print(f"unknown workloads {unknown}; choose from {[*WORKLOADS, 'host']}", file=sys.stderr)
        return 2
    if args.peer and not os.path.isfile(args.peer):
        print(f"--peer {args.peer!r}: no such file", file=sys.stderr)
        return 2
    run(names, args.peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
