"""The toy world's stage actors for a :class:`~.placement.Placement`: in-process or process-backed.

:class:`InProcessStages` keeps the original behaviour: three :class:`~engine.LocalStageActor` s in the
scheduler's process, each stage's model on its own device; the denoise actor owns the session slots.

:class:`ProcessStages` runs each stage as a :class:`~engine.workers.ProcessWorkerGroup` of
:class:`~.ranks.ToyWorldRank` s owned by exactly one :class:`~engine.ParallelWorkerStageActor`:

* co-located decode (same devices and world size as denoise): ONE actor object owns the denoise
  group and is mapped to both stage ids ``denoise`` and ``decode`` (the orchestrator starts and
  closes it once); the latent artifact is a :class:`~.ranks.ResidentLatent` handle;
* independent decode: its own group and actor; the latent artifact holds only
  :class:`~engine.tensor_channel.WorkerTensorRef` s of the slot's latent channel.

The world made by encode reaches the denoise ranks through the slot's world channel (refs in the
:class:`Condition`). The scheduler tracks refs it forwarded but that were never consumed, and a
stage's session hook discards them (``channel.discard``) before the session's slot is reused.

Failure (a rank process dies): the group fails, its owning actor fails, the orchestrator fails every
session on it, :attr:`StageHost.failure` names the stage and reason and :attr:`StageHost.failed` is
set. The service then leaves ``running()`` with that failure (it does not restart groups; its owner
replaces the whole service): see :mod:`.service`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import torch
import trio

from engine import (
    LocalStageActor,
    ParallelWorkerStageActor,
    capture_memory_snapshot,
)
from engine.slots import SlotPool
from engine.tensor_channel import WorkerTensorChannel
from engine.workers import ProcessWorkerGroup

from .model import SessionSlots, ToyWorldConfig, ToyWorldModel
from .placement import STAGES, Placement
from .pose import Pose, integrate_pose
from .ranks import ToyWorldRank

__all__ = ["ChunkControl", "Condition", "EncodeRequest", "InProcessStages", "ProcessStages", "make_stages"]

CHANNEL_TIMEOUT = 60.0  # seconds a producer waits for a consumer before the stage is failed
START_TIMEOUT = 180.0


@attrs.frozen
class EncodeRequest:
    """Encode the reference image into the session's base world (only the first request carries it)."""

    index: int
    image: np.ndarray | None = attrs.field(eq=False)
    needs_world: bool
    slot: int = -1


@attrs.frozen
class Condition:
    """``world``: the base world latent (in-process), its channel refs (process), or None after chunk 0."""

    index: int
    world: Any = attrs.field(eq=False)


@attrs.frozen
class ChunkControl:
    """The control snapshot one chunk is generated from (immutable: it is also reported)."""

    index: int
    slot: int
    keys: frozenset[str]
    reset_pose: bool
    noise_seed: int
    prompt: str | None  # conditions this chunk (a new prompt takes effect on the next chunk)
    resolution: tuple[int, int] | None = None  # (height, width) of the session's frames; None: the default


Notify = Callable[[str, int], None]  # (session_id, chunk index) once a chunk's denoise finished (any thread)


class _StageHost:
    placement: Placement
    pool: SlotPool
    failure: str | None = None

    def __init__(self, config: ToyWorldConfig, max_sessions: int, placement: Placement, notify: Notify) -> None:
        self.config = config
        self.max_sessions = max_sessions
        self.placement = placement
        self.notify = notify
        self.slot_of: dict[str, int] = {}
        self.failure = None
        self.failed = trio.Event()  # set (in the trio thread) once a stage's actor failed

    def acquire_slot(self, session_id: str) -> int:
        slot = self.pool.acquire()  # SlotPoolFullError when every retained slot is taken
        self.slot_of[session_id] = slot
        return slot

    def stage_config(self, stage: str) -> ToyWorldConfig:
        runtime = self.placement.runtime(stage)
        return attrs.evolve(self.config, device=runtime.devices[0], dtype=runtime.torch_dtype)

    @property
    def bytes_per_session(self) -> int:
        cfg = self.stage_config("denoise")
        c, (h, w) = cfg.latent_channels, cfg.latent_size
        return (cfg.appearance_numel + cfg.cache_frames * c * h * w) * torch.empty((), dtype=cfg.dtype).element_size()

    def _watch(self, stage: str, actor: Any) -> None:
        def on_failed(reason: str) -> None:
            if self.failure is None:
                self.failure = f"stage {stage!r} failed: {reason}"
                self.failed.set()

        actor.add_failure_listener(on_failed)


class InProcessStages(_StageHost):
    """Today's handlers on LocalStageActors (``service._model`` / ``service._slots`` stay available)."""

    async def start(self, handlers: Mapping[str, Callable[[Any], Mapping[str, Any]]] | None = None) -> dict[str, Any]:
        """The actors; ``handlers`` (stage -> callable) stand in for :meth:`encode` / :meth:`denoise` /
        :meth:`decode` (the service routes them through its own methods, so they can be wrapped)."""
        handlers = {"encode": self.encode, "denoise": self.denoise, "decode": self.decode, **(handlers or {})}
        models: dict[tuple[str, torch.dtype], ToyWorldModel] = {}
        self.models: dict[str, ToyWorldModel] = {}
        for stage in STAGES:  # one model per distinct (device, dtype); equal runtimes share it
            cfg = self.stage_config(stage)
            key = (cfg.device, cfg.dtype)
            if key not in models:
                models[key] = await trio.to_thread.run_sync(ToyWorldModel, cfg)
            self.models[stage] = models[key]
        self.slots = await trio.to_thread.run_sync(SessionSlots, self.max_sessions, self.stage_config("denoise"))
        self.pool = self.slots.pool
        deadline = self.placement.call_timeout  # a call past it fails its actor, and the service with it
        actors = {
            "encode": LocalStageActor(handlers["encode"], name="toy-world-encode", call_timeout=deadline),
            "denoise": LocalStageActor(handlers["denoise"], name="toy-world-denoise", session_closer=self._release_slot,
                                       call_timeout=deadline),
            "decode": LocalStageActor(handlers["decode"], name="toy-world-decode", call_timeout=deadline),
        }
        for stage, actor in actors.items():
            self._watch(stage, actor)
        return actors

    async def aclose(self) -> None:
        pass

    def memory_snapshots(self) -> tuple[Any, ...]:
        return (capture_memory_snapshot("toy_world", self.placement.denoise.devices[0]),)

    def encode(self, invocation: Any) -> Mapping[str, Any]:
        request: EncodeRequest = invocation.inputs["encode_request"]
        world = self.models["encode"].encode_world(request.image) if request.needs_world else None
        return {"condition": Condition(request.index, world)}

    def denoise(self, invocation: Any) -> Mapping[str, Any]:
        condition: Condition = invocation.inputs["condition"]
        control: ChunkControl = invocation.inputs["control"]
        model, slots, slot = self.models["denoise"], self.slots, control.slot
        if condition.world is not None:
            slots.world(slot).copy_(condition.world)
        pose = Pose() if control.reset_pose else slots.pose(slot)
        poses = integrate_pose(pose, control.keys, self.config.frames_per_chunk, self.config)
        world = model.condition_on_prompt(slots.world(slot), control.prompt)
        latents = model.denoise_chunk(world, poses, slots.cache(slot), control.noise_seed, control.resolution)
        slots.set_pose(slot, poses[-1])
        self.notify(invocation.key.session_id, control.index)
        return {"latent": (latents, control, poses)}

    def decode(self, invocation: Any) -> Mapping[str, Any]:
        latents, control, poses = invocation.inputs["latent"]
        return {"frames": (self.models["decode"].decode_frames(latents), control, poses)}

    def _release_slot(self, context: Any, reason: Any) -> None:
        """The denoise actor's session hook: zero and return the session's slot."""
        slot = self.slot_of.get(context.session_id)
        if slot is not None:
            self.slots.release(slot)  # if this raises, the mapping stays: a retried cleanup releases it
            del self.slot_of[context.session_id]


class ProcessStages(_StageHost):
    """Process-backed worker groups, one owning actor each (module docs)."""

    async def start(self, handlers: Any = None) -> dict[str, Any]:
        """The actors, once every group has started (``handlers`` apply to in-process placement only)."""
        p, n = self.placement, self.max_sessions
        self.pool = SlotPool(n, name="Toy world session")
        self.world_channels = tuple(WorkerTensorChannel(p.denoise.world_size, timeout=CHANNEL_TIMEOUT) for _ in range(n))
        self.latent_channels = () if p.colocated_decode else tuple(
            WorkerTensorChannel(p.decode.world_size, timeout=CHANNEL_TIMEOUT) for _ in range(n)
        )
        self._pending_world: dict[str, Any] = {}  # session -> world refs forwarded, not yet consumed
        self._pending_latents: dict[str, dict[int, Any]] = {}  # session -> {index: latent refs}
        group_stages = {"encode": ("encode",), "denoise": ("denoise", "decode") if p.colocated_decode else ("denoise",)}
        if not p.colocated_decode:
            group_stages["decode"] = ("decode",)
        self.groups: dict[str, ProcessWorkerGroup] = {}
        for stage, served in group_stages.items():
            runtime = p.runtime(stage)
            factory = functools.partial(
                ToyWorldRank, config=self.config, stages=served, dtype=runtime.dtype, max_sessions=n,
                world_channels=self.world_channels if stage in ("encode", "denoise") else (),
                latent_channels=self.latent_channels if stage in ("denoise", "decode") else (),
            )
            self.groups[stage] = ProcessWorkerGroup(
                factory, world_size=runtime.world_size, device_ids=runtime.devices, gather=("snapshot",),
                name=f"toy-world-{'+'.join(served)}", close_timeout=5.0, kill_grace=1.0, call_timeout=p.call_timeout,
            )
        errors: list[BaseException] = []
        try:
            async with trio.open_nursery() as nursery:  # spawn the groups side by side
                for stage, group in self.groups.items():
                    nursery.start_soon(self._start_group, stage, group, errors)
        finally:
            if errors or not all(group.started for group in self.groups.values()):
                with trio.CancelScope(shield=True):
                    await self.aclose()
        if errors:
            raise errors[0]
        return self._actors()

    @staticmethod
    async def _start_group(stage: str, group: ProcessWorkerGroup, errors: list[BaseException]) -> None:
        try:
            await trio.to_thread.run_sync(group.start, START_TIMEOUT)
        except Exception as exc:
            error = RuntimeError(f"stage {stage!r}: its worker group could not start: {exc}")
            error.__cause__ = exc
            errors.append(error)

    def _actors(self) -> dict[str, Any]:
        common = dict(input_builder=self._inputs, output_builder=self._outputs, method_name="run_stage")
        encode = ParallelWorkerStageActor(self.groups["encode"], name="toy-world-encode", **common)
        denoise = ParallelWorkerStageActor(
            self.groups["denoise"], name=self.groups["denoise"].name, session_closer=self._close_denoise,
            mailbox_capacity=2 if self.placement.colocated_decode else 1, **common,
        )
        if self.placement.colocated_decode:
            decode = denoise  # one owner for the group, serving both stages
        else:
            decode = ParallelWorkerStageActor(
                self.groups["decode"], name="toy-world-decode", session_closer=self._close_decode, **common
            )
        actors = {"encode": encode, "denoise": denoise, "decode": decode}
        for stage, actor in actors.items():
            self._watch(stage, actor)
        return actors

    # -- builders (on the owning actor's thread, in the scheduler's process) --------------------------

    def _inputs(self, inv: Any) -> tuple[tuple, dict]:
        stage, session_id = inv.key.stage_id, inv.key.session_id
        if stage == "encode":
            request: EncodeRequest = inv.inputs["encode_request"]
            return ("encode", request.slot, request.image, request.needs_world), {}
        if stage == "denoise":
            condition: Condition = inv.inputs["condition"]
            if condition.world is not None:
                self._pending_world.pop(session_id, None)
            return ("denoise", session_id, condition.world, inv.inputs["control"]), {}
        latent, control, _ = inv.inputs["latent"]
        self._pending_latents.get(session_id, {}).pop(control.index, None)
        return ("decode", control.slot, latent), {}

    def _outputs(self, result: Any, inv: Any) -> Mapping[str, Any]:
        stage, session_id = inv.key.stage_id, inv.key.session_id
        if stage == "encode":
            request: EncodeRequest = inv.inputs["encode_request"]
            if result is not None:
                self._pending_world[session_id] = result
            return {"condition": Condition(request.index, result)}
        if stage == "denoise":
            latent, poses = result
            control: ChunkControl = inv.inputs["control"]
            if not self.placement.colocated_decode:
                self._pending_latents.setdefault(session_id, {})[control.index] = latent
            self.notify(session_id, control.index)
            return {"latent": (latent, control, poses)}
        _, control, poses = inv.inputs["latent"]
        return {"frames": (result, control, poses)}

    # -- session hooks (reverse topological order: decode, denoise, encode) --------------------------

    def _close_decode(self, context: Any, reason: Any) -> None:
        """Independent decode: discard latents the scheduler dropped, so the slot's channel stays in order."""
        pending = self._pending_latents.pop(context.session_id, {})
        slot = self.slot_of.get(context.session_id)
        for index in sorted(pending):
            if slot is not None:
                self.latent_channels[slot].discard(pending[index])

    def _close_denoise(self, context: Any, reason: Any) -> None:
        """Drop the session's world refs, resident latents and slot storage in the ranks; free the slot.

        Co-located, this hook is decode's and denoise's (one actor): it is idempotent.
        """
        session_id = context.session_id
        slot = self.slot_of.get(session_id)
        world = self._pending_world.pop(session_id, None)
        if world is not None and slot is not None:
            self.world_channels[slot].discard(world)
        if slot is None:
            return
        self.groups["denoise"].call("release_session", session_id, slot)()
        self.pool.release(slot)  # forgotten only once released: a failed release is retried
        del self.slot_of[session_id]

    # -- the rest ------------------------------------------------------------------------------------

    def memory_snapshots(self) -> tuple[Any, ...]:
        return tuple(self.groups["denoise"].call("snapshot", "toy_world")())

    async def aclose(self) -> None:
        """Close any group still open (the actors close theirs) and unlink the channels (parent owns them)."""
        for group in getattr(self, "groups", {}).values():
            await trio.to_thread.run_sync(group.close)
        for channel in (*getattr(self, "world_channels", ()), *getattr(self, "latent_channels", ())):
            channel.close()


def make_stages(config: ToyWorldConfig, max_sessions: int, placement: Placement, notify: Notify) -> _StageHost:
    cls = ProcessStages if placement.mode == "process" else InProcessStages
    return cls(config, max_sessions, placement, notify)
