"""The toy world's worker ranks for ``process`` placement (one object per rank process).

A :class:`ToyWorldRank` serves one or more stages (``("encode",)``, ``("denoise",)``,
``("decode",)`` or, co-located, ``("denoise", "decode")``) for every session, through one method,
:meth:`ToyWorldRank.run_stage`, so one :class:`~engine.parallel_actor.ParallelWorkerStageActor` can
own a group that serves two stages. Ranks of a group are replicas: each builds the seeded model on
its own device and computes; rank 0 answers (and is the one producer of the group's channels).

Tensors between groups go through :class:`~engine.tensor_channel.WorkerTensorChannel` s made by the
service (the parent) and handed to the ranks by their factory (``functools.partial``): one *world*
channel per session slot (encode ranks produce, denoise ranks consume) and, when decode is an
independent group, one *latent* channel per slot (denoise produces, decode consumes). Per-slot
channels keep every channel's transfers in the order its consumer resolves them: within a session a
stage takes its sequence ids in order, and a slot serves one session at a time (a transfer that will
never be received is discarded by the scheduler before the slot is reused).

State: a denoise rank keeps each session's world latent, latent cache and pose in its own
:class:`RankSlots` (indexed by the slot id the scheduler's pool assigned). A co-located group keeps
each chunk's latents resident (keyed by session and chunk index) between its denoise and decode
calls; the scheduler only holds a :class:`ResidentLatent` handle.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from engine.tensor_channel import WorkerTensorChannel

from .model import SessionSlots, ToyWorldConfig, ToyWorldModel
from .pose import Pose, integrate_pose

__all__ = ["RankSlots", "ResidentLatent", "ToyWorldRank"]


@attrs.frozen
class ResidentLatent:
    """A chunk's latents kept in the co-located denoise/decode ranks (the scheduler holds only this)."""

    session_id: str
    index: int


class RankSlots(SessionSlots):
    """A denoise rank's slot storage; slot ids are assigned by the scheduler's pool, not here."""

    def _check_in_use(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot!r} is out of range [0, {self.capacity})")

    def release(self, slot: int) -> None:
        self._check_in_use(slot)
        self.worlds[slot].zero_()
        self.caches[slot].zero_()
        self.poses[slot].zero_()


class ToyWorldRank:
    """One rank process of a toy world stage group (module docs)."""

    def __init__(
        self,
        *,
        config: ToyWorldConfig,
        stages: tuple[str, ...],
        dtype: str,
        max_sessions: int,
        world_channels: tuple[WorkerTensorChannel, ...] = (),
        latent_channels: tuple[WorkerTensorChannel, ...] = (),
        rank: int,
        world_size: int,
        device: str,
    ) -> None:
        from .placement import DTYPES

        torch.set_num_threads(1)
        self.rank = rank
        self.world_size = world_size
        self.stages = tuple(stages)
        self.config = attrs.evolve(config, device=device, dtype=DTYPES[dtype])
        self.model = ToyWorldModel(self.config)
        self.world_channels = tuple(world_channels)
        self.latent_channels = tuple(latent_channels)
        self.slots = RankSlots(max_sessions, self.config) if "denoise" in self.stages else None
        self.resident: dict[tuple[str, int], torch.Tensor] = {}

    def ping(self) -> int:
        return self.rank

    def snapshot(self, role: str) -> Any:
        """This rank's memory snapshot after warm-up (for the server's capacity plan)."""
        from engine.capacity import capture_memory_snapshot

        return capture_memory_snapshot(role, self.config.device, rank=self.rank)

    def run_stage(self, stage: str, *args: Any) -> Any:
        if stage not in self.stages:
            raise ValueError(f"rank {self.rank} serves {list(self.stages)}, not {stage!r}")
        return getattr(self, f"_{stage}")(*args)

    # -- stages ------------------------------------------------------------------------------------

    def _encode(self, slot: int, image: np.ndarray | None, needs_world: bool) -> Any:
        """The session's base world, sent to the denoise ranks through the slot's world channel (refs)."""
        if not needs_world:
            return None
        world = self.model.encode_world(image)
        return self.world_channels[slot].send(world) if self.rank == 0 else None

    def _denoise(self, session_id: str, world: Any, control: Any) -> tuple[Any, list[Pose]]:
        assert self.slots is not None
        slot = control.slot
        if world is not None:  # refs of the base world: keep it resident in the session's slot
            channel = self.world_channels[slot]
            got = channel.receive(world, rank=self.rank, copy=False)
            try:
                self.slots.world(slot).copy_(got)
            finally:
                del got
                channel.release(world, rank=self.rank)
        pose = Pose() if control.reset_pose else self.slots.pose(slot)
        poses = integrate_pose(pose, control.keys, self.config.frames_per_chunk, self.config)
        conditioned = self.model.condition_on_prompt(self.slots.world(slot), control.prompt)
        latents = self.model.denoise_chunk(
            conditioned, poses, self.slots.cache(slot), control.noise_seed, control.resolution
        )
        self.slots.set_pose(slot, poses[-1])
        if "decode" in self.stages:  # co-located: the latent never leaves the ranks
            self.resident[(session_id, control.index)] = latents
            return ResidentLatent(session_id, control.index), poses
        refs = self.latent_channels[slot].send(latents) if self.rank == 0 else None
        return refs, poses

    def _decode(self, slot: int, latent: Any) -> np.ndarray | None:
        if isinstance(latent, ResidentLatent):
            latents = self.resident.pop((latent.session_id, latent.index))
            frames = self.model.decode_frames(latents)
        else:
            channel = self.latent_channels[slot]
            got = channel.receive(latent, rank=self.rank, copy=False)
            try:
                frames = self.model.decode_frames(got)
            finally:
                del got
                channel.release(latent, rank=self.rank)
        return frames if self.rank == 0 else None

    # -- sessions ----------------------------------------------------------------------------------

    def release_session(self, session_id: str, slot: int | None) -> int:
        """Drop the session's resident latents and zero its slot; returns how many latents were dropped."""
        dropped = [key for key in self.resident if key[0] == session_id]
        for key in dropped:
            del self.resident[key]
        if slot is not None and self.slots is not None:
            self.slots.release(slot)
        return len(dropped)

    def close(self) -> None:
        for channel in (*self.world_channels, *self.latent_channels):
            channel.detach()
