"""A tensor artifact through the scheduler as refs only (reference C.4).

Two stages, each a ProcessWorkerGroup owned by a ParallelWorkerStageActor:
denoise (1 rank) consumes the "control" ingress and sends a latent through a
WorkerTensorChannel, returning only its refs; decode (2 ranks, shard_dim=-2)
receives its half zero-copy, checks it and answers small uint8 frames.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from typing import Any

import numpy as np
import torch
import trio

from engine import (
    EdgeSpec,
    ParallelWorkerStageActor,
    PipelineSpec,
    StageSpec,
    open_orchestrator,
)
from engine.tensor_channel import WorkerTensorChannel, WorkerTensorRef
from engine.tensor_tree import leaves_of
from engine.workers import ProcessWorkerGroup

from .tensor_ranks import LATENT_SHAPE, DecodeRank, DenoiseRank, frames_for, latent_for

SEQUENCES = 6


def all_leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for v in tree.values() for leaf in all_leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [leaf for v in tree for leaf in all_leaves(v)]
    return [tree]


def control_of(seq: int) -> int:
    return 7 * seq + 3


async def test_latent_travels_as_refs_between_process_worker_groups():
    spec = PipelineSpec(
        stages=[StageSpec("denoise", {"control"}, {"latent"}), StageSpec("decode", {"latent"}, {"frames"})],
        edges=[EdgeSpec("control", "denoise", None, 2), EdgeSpec("latent", "decode", "denoise", 1)],
        output_artifacts={"frames"},
    )
    channel = WorkerTensorChannel(2, timeout=10, shard_dim=-2)
    denoise_group = ProcessWorkerGroup(functools.partial(DenoiseRank, channel=channel), name="denoise", close_timeout=5)
    decode_group = ProcessWorkerGroup(
        functools.partial(DecodeRank, channel=channel), world_size=2, gather=("decode",), name="decode", close_timeout=5
    )
    seen_latents: list[Any] = []

    def decode_inputs(inv: Any) -> tuple[tuple, dict]:  # in the parent, on the decode actor's thread
        latent = inv.inputs["latent"]
        assert leaves_of(latent, torch.Tensor) == [], "a tensor reached the scheduler"
        refs = leaves_of(latent, WorkerTensorRef)
        assert refs and all_leaves(latent) == refs, f"only refs in the latent artifact, got {latent!r}"
        assert refs[0].shape == LATENT_SHAPE and refs[0].shard_dim == 3
        seen_latents.append(latent)
        return (latent, inv.key.sequence_id), {}

    def decode_outputs(results: list[dict], inv: Any) -> dict[str, Any]:
        return {"frames": results}

    try:
        with trio.fail_after(90):  # three torch-importing spawns; a shared CI machine can take a minute
            await trio.to_thread.run_sync(denoise_group.start)
            await trio.to_thread.run_sync(decode_group.start)
            pids = denoise_group.pids + decode_group.pids
            actors = {
                "denoise": ParallelWorkerStageActor(
                    denoise_group, "denoise", name="denoise",
                    input_builder=lambda inv: ((inv.inputs["control"], inv.key.sequence_id), {}),
                    output_builder=lambda refs, inv: {"latent": refs},
                ),
                "decode": ParallelWorkerStageActor(
                    decode_group, "decode", name="decode", input_builder=decode_inputs, output_builder=decode_outputs
                ),
            }
            outputs: list[tuple[int, Any]] = []
            async with (
                open_orchestrator(spec, actors, close_timeout=15) as orch,
                orch.session("s1", final_sequence_id=SEQUENCES - 1) as session,
            ):

                async def feed() -> None:
                    for seq in range(SEQUENCES):
                        await session.push(seq, {"control": control_of(seq)})

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(feed)
                    async for seq, artifacts in session.outputs():
                        outputs.append((seq, artifacts["frames"]))
                    assert session.error is None, repr(session.error)
            assert denoise_group.closed and decode_group.closed  # the actors closed the groups they own
    finally:  # a failed run still leaves no process, mapping or segment behind
        for group in (denoise_group, decode_group):
            await trio.to_thread.run_sync(group.close)
        channel.close()

    assert [seq for seq, _ in outputs] == list(range(SEQUENCES))
    for seq, per_rank in outputs:
        full = latent_for(control_of(seq), seq)
        halves = torch.tensor_split(full, 2, dim=-2)
        assert [r["rank"] for r in per_rank] == [0, 1]
        assert [r["rows"] for r in per_rank] == [(0, 30), (30, 60)]
        for rank, result in enumerate(per_rank):
            assert result["offset"] == control_of(seq) + 1000 * seq
            assert result["frames"].dtype == np.uint8
            assert np.array_equal(result["frames"], frames_for(halves[rank]))
    assert len(seen_latents) == SEQUENCES
    assert [leaves_of(x, WorkerTensorRef)[0].transfer_id for x in seen_latents] == list(range(1, SEQUENCES + 1))

    channel.close()
    assert channel.closed
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"cl_{channel.channel_id}_")] == []
    assert multiprocessing.active_children() == []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"rank process {pid} is still alive")
