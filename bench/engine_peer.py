"""The peer scheduler on the same workloads, for ``python -m bench.engine --peer PATH``.

The peer is the public streaming orchestrator the seeds describe (``StreamingPipelineOrchestrator``,
one stdlib-only module built on threads and futures). It is not part of chunkline and is never
copied into it: the bench loads it from a file you name, and runs the same graph, handlers and
workloads through its public API. Its own idiom drives it: a thread per session pushes what fits
(``try_push_inputs``), takes what was emitted (``poll_outputs``), and otherwise waits for the
next completion.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["load_peer", "run_peer_workload"]


def load_peer(path: str) -> ModuleType:
    """Import the peer's orchestrator module from a file (a ValueError naming the file if it is not one)."""
    spec = importlib.util.spec_from_file_location("chunkline_bench_peer", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--peer {path!r} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    if not hasattr(module, "StreamingPipelineOrchestrator"):
        raise ValueError(f"--peer {path!r} has no StreamingPipelineOrchestrator")
    return module


def _peer_spec(peer: ModuleType, depth: int = 2) -> Any:
    stage, edge = peer.StreamingStageSpec, peer.StreamingEdgeSpec
    return peer.StreamingPipelineSpec(
        stages=(
            stage("encode", frozenset({"image"}), frozenset({"condition"})),
            stage("denoise", frozenset({"condition", "control"}), frozenset({"latent"})),
            stage("decode", frozenset({"latent"}), frozenset({"frames"})),
        ),
        edges=(
            edge("image", "encode", None, depth),
            edge("condition", "denoise", "encode", depth),
            edge("control", "denoise", None, depth),
            edge("latent", "decode", "denoise", depth),
        ),
        output_artifacts=frozenset({"frames"}),
        output_capacity_per_session=depth,
    )


def run_peer_workload(
    peer: ModuleType,
    sessions: int,
    chunks: int,
    handlers: dict[str, Callable],
    pacing: float | None,
    depth: int = 2,
) -> dict[str, Any]:
    """Run one workload on the peer (every edge and the output buffer ``depth`` deep); returns the raw stamps."""
    actors = {name: peer.LocalStageActor(handler, name=name) for name, handler in handlers.items()}
    orch = peer.StreamingPipelineOrchestrator(_peer_spec(peer, depth), actors)
    ids = [f"s{i}" for i in range(sessions)]
    for sid in ids:
        orch.create_session(sid, final_sequence_id=chunks - 1)
    emitted: list[tuple[float, int, int]] = []
    control_at: list[dict[int, float]] = [{} for _ in range(sessions)]
    latencies: list[float] = []
    finish = [0.0] * sessions
    lock = threading.Lock()
    start = time.perf_counter()

    # The peer's public waits return only once a session is idle, which would charge it a whole
    # pipeline drain per output; to give it its best figures the driver waits on the condition the
    # peer notifies on every completion, holding its lock while it checks, so no wake-up is lost.
    changed = getattr(orch, "_idle", None)

    def wait(sid: str, timeout: float) -> None:
        if changed is not None:
            changed.wait(timeout)
        elif orch.wait_until_idle(sid, timeout=timeout):
            time.sleep(timeout)

    def drive(index: int) -> None:
        sid = ids[index]
        image = control = received = 0
        while received < chunks:
            with changed if changed is not None else threading.Lock():
                progressed = False
                if pacing is None:
                    while image < chunks and orch.try_push_inputs(sid, image, {"image": image, "control": image}):
                        control_at[index][image] = time.perf_counter()
                        image += 1
                        progressed = True
                else:
                    while image < chunks and orch.try_push_inputs(sid, image, {"image": image}):
                        image += 1
                        progressed = True
                    while control < chunks and time.perf_counter() - start >= control * pacing:
                        if not orch.try_push_inputs(sid, control, {"control": control}):
                            break
                        control_at[index][control] = time.perf_counter()
                        control += 1
                        progressed = True
                outputs = orch.poll_outputs(sid)
                now = time.perf_counter()
                with lock:
                    for seq, _artifact, _value in outputs:
                        emitted.append((now, index, seq))
                        latencies.append(now - control_at[index][seq])
                received += len(outputs)
                if progressed or outputs or received >= chunks:
                    continue
                timeout = 0.05
                if pacing is not None and control < chunks:
                    timeout = max(0.0, min(timeout, start + control * pacing - time.perf_counter()))
                wait(sid, timeout)
        finish[index] = time.perf_counter() - start

    threads = [threading.Thread(target=drive, args=(i,), name=f"peer-driver-{i}") for i in range(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    orch.close()
    return {"wall": wall, "emitted": emitted, "control_at": control_at, "latencies": latencies, "finish": finish}
