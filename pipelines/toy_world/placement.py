"""Where the toy world's stages run: :class:`Placement`, a validated, first-class configuration.

Every stage (``encode``, ``denoise``, ``decode``) has its own complete :class:`StageRuntime`: a
device list, a world size (one rank per device) and a dtype. Nothing is shared or inherited between
stages -- in particular there is no fallback from decode's runtime to encode's.

Modes
-----
``in-process`` (the default): every stage runs on a thread of the scheduler's process, as before;
each stage's model lives on its stage's single device (world size 1).

``process``: every stage is a :class:`~engine.workers.ProcessWorkerGroup` (one spawned process per
rank) owned by exactly one :class:`~engine.parallel_actor.ParallelWorkerStageActor`. Ranks of a
group are replicas (the toy model is small): each computes, rank 0 answers.

* **Co-location rule** (:attr:`Placement.colocated_decode`): when denoise and decode have exactly the
  same device list and world size, decode runs inside the denoise worker group -- one actor object
  owns that group and serves both stages; the latent stays resident in the ranks and the scheduler
  only sees a small handle. Otherwise decode is its own group and actor, and the latent travels from
  the denoise ranks to the decode ranks through a :class:`~engine.tensor_channel.WorkerTensorChannel`:
  the scheduler's process holds only :class:`~engine.tensor_channel.WorkerTensorRef` s for it.
* The session's base world latent (made by encode when a session starts) reaches the denoise ranks
  through a channel too and stays resident in the session's slot there.

Resource groups are never created implicitly: placement implies no serialization, and two
independent stages may share a physical device. A deployment that needs a limit declares it
(``resource_groups``) and it shows in the pipeline spec (:func:`pipeline_spec`). Memory pressure is
solved by moving stages, not by a hidden global lock.

Placement file (JSON; ``chunkline run|stream-serve --placement FILE``)::

    {
      "mode": "process",                       // "in-process" (default) or "process"
      "encode":  {"devices": ["cpu"], "world_size": 1, "dtype": "float32"},
      "denoise": {"devices": ["cuda:0", "cuda:1"], "world_size": 2, "dtype": "bfloat16"},
      "decode":  {"devices": ["cuda:2"], "world_size": 1},
      "resource_groups": [                     // optional, explicit only
        {"name": "gpu2", "max_concurrency": 1, "stages": ["decode"]}
      ]
    }

(comments are not JSON: shown here only). Each of ``encode``, ``denoise`` and ``decode`` is
required. ``world_size`` defaults to the number of devices, ``dtype`` to ``float32`` (one of
``float32``, ``float16``, ``bfloat16``, ``float64``). Devices are ``cpu``, ``cuda`` or ``cuda:N``.
An impossible placement is refused when it is built, with a ``ValueError`` naming the stage and the
problem: an unknown device, a world size that does not match the device list, CUDA on a machine
without it (or a CUDA index beyond the devices present), several ranks in ``in-process`` mode, an
unknown key, a resource group naming an unknown stage, or more ranks (worker processes) than
:mod:`pipelines.placement_limits` allows: 16 a stage, 32 in all.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from engine import EdgeSpec, PipelineSpec, ResourceGroupSpec, StageSpec

from pipelines.json_objects import RepeatedKey, refuse_repeated_keys
from pipelines.placement_limits import placement_text, stage_ranks_problem, total_ranks_problem

__all__ = [
    "DTYPES",
    "MODES",
    "STAGES",
    "Placement",
    "ResourceGroupDecl",
    "StageRuntime",
    "load_placement",
    "pipeline_spec",
]

STAGES = ("encode", "denoise", "decode")
MODES = ("in-process", "process")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _check_device(stage: str, device: object) -> str:
    if not isinstance(device, str) or not device.strip():
        raise ValueError(f"stage {stage!r}: a device must be a non-empty string like 'cpu' or 'cuda:0', got {device!r}")
    try:
        parsed = torch.device(device.strip())
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"stage {stage!r}: unknown device {device!r} (use 'cpu', 'cuda' or 'cuda:N')") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"stage {stage!r}: unknown device {device!r} (use 'cpu', 'cuda' or 'cuda:N')")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"stage {stage!r}: device {device!r} asks for CUDA, but CUDA is not available on this machine "
                "(torch.cuda.is_available() is False)"
            )
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"stage {stage!r}: device {device!r} does not exist (this machine has {count} CUDA device(s))")
    return str(parsed)


@attrs.frozen
class StageRuntime:
    """One stage's complete runtime: ``devices`` (one per rank), ``world_size`` and ``dtype`` (a name)."""

    devices: tuple[str, ...] = attrs.field(converter=tuple)
    world_size: int
    dtype: str = "float32"
    stage: str = attrs.field(default="stage", eq=False, repr=False)  # for messages only

    def __attrs_post_init__(self) -> None:
        where = f"stage {self.stage!r}"
        if not self.devices:
            raise ValueError(f"{where}: needs at least one device")
        if (problem := stage_ranks_problem(self.stage, len(self.devices))) is not None:  # before a process is spawned
            raise ValueError(problem)
        object.__setattr__(self, "devices", tuple(_check_device(self.stage, d) for d in self.devices))
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise ValueError(f"{where}: world_size must be an int >= 1, got {self.world_size!r}")
        if self.world_size != len(self.devices):
            raise ValueError(
                f"{where}: world_size {self.world_size} does not match {len(self.devices)} device(s) "
                f"{list(self.devices)} (one device per rank)"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"{where}: dtype {self.dtype!r} is not one of {sorted(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_dict(cls, stage: str, data: object) -> StageRuntime:
        if isinstance(data, StageRuntime):
            return attrs.evolve(data, stage=stage)
        if not isinstance(data, Mapping):
            raise ValueError(f"stage {stage!r}: runtime must be an object with 'devices', got {data!r}")
        unknown = sorted(set(data) - {"devices", "world_size", "dtype"})
        if unknown:
            raise ValueError(f"stage {stage!r}: unknown runtime key(s) {unknown} (allowed: devices, world_size, dtype)")
        devices = data.get("devices")
        if isinstance(devices, str):
            devices = [devices]
        if not isinstance(devices, list | tuple):
            raise ValueError(f"stage {stage!r}: 'devices' must be a list of device names, got {devices!r}")
        world_size = data.get("world_size", len(devices))
        return cls(tuple(devices), world_size, data.get("dtype", "float32"), stage=stage)

    def as_dict(self) -> dict[str, Any]:
        return {"devices": list(self.devices), "world_size": self.world_size, "dtype": self.dtype}


@attrs.frozen
class ResourceGroupDecl:
    """A declared resource group: at most ``max_concurrency`` calls of ``stages`` at once."""

    name: str
    max_concurrency: int
    stages: tuple[str, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"resource group name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.max_concurrency, int) or self.max_concurrency < 1:
            raise ValueError(f"resource group {self.name!r}: max_concurrency must be an int >= 1")
        if not self.stages:
            raise ValueError(f"resource group {self.name!r}: names no stage")
        for stage in self.stages:
            if stage not in STAGES:
                raise ValueError(f"resource group {self.name!r}: unknown stage {stage!r} (stages: {list(STAGES)})")


DEFAULT_CALL_TIMEOUT = 90.0  # far past any toy-world call (milliseconds) and past a tensor channel's wait
MAX_CALL_TIMEOUT = 86400.0


@attrs.frozen
class Placement:
    """Mode, one :class:`StageRuntime` per stage and the declared resource groups (module docs)."""

    mode: str
    encode: StageRuntime
    denoise: StageRuntime
    decode: StageRuntime
    resource_groups: tuple[ResourceGroupDecl, ...] = attrs.field(converter=tuple, default=())
    # seconds a stage call may go unanswered before its stage (and the service) is failed: a rank frozen with SIGSTOP,
    # or a call stuck in a worker group or on an in-process stage's thread, held its sessions without frames for ever
    call_timeout: float = DEFAULT_CALL_TIMEOUT

    def __attrs_post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"placement mode must be one of {list(MODES)}, got {self.mode!r}")
        timeout = self.call_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= MAX_CALL_TIMEOUT:
            raise ValueError(f"placement: call_timeout must be a number of seconds in (0, {MAX_CALL_TIMEOUT:g}], "
                             f"got {timeout!r}")
        for stage in STAGES:
            runtime = getattr(self, stage)
            if not isinstance(runtime, StageRuntime):
                raise ValueError(f"stage {stage!r}: needs a StageRuntime, got {runtime!r}")
            object.__setattr__(self, stage, attrs.evolve(runtime, stage=stage))
            if self.mode == "in-process" and runtime.world_size != 1:
                raise ValueError(
                    f"stage {stage!r}: world_size {runtime.world_size} needs mode 'process' "
                    "(in-process placement runs each stage on one device in the scheduler's process)"
                )
        if (problem := total_ranks_problem({s: getattr(self, s).world_size for s in STAGES})) is not None:
            raise ValueError(f"placement: {problem}")
        seen: dict[str, str] = {}
        names: set[str] = set()
        for group in self.resource_groups:
            if group.name in names:
                raise ValueError(f"resource group {group.name!r} is declared twice")
            names.add(group.name)
            for stage in group.stages:
                if stage in seen:
                    raise ValueError(f"stage {stage!r} is in two resource groups: {seen[stage]!r} and {group.name!r}")
                seen[stage] = group.name

    @property
    def colocated_decode(self) -> bool:
        """Process mode, and denoise and decode use exactly the same devices and world size."""
        return (
            self.mode == "process"
            and self.denoise.devices == self.decode.devices
            and self.denoise.world_size == self.decode.world_size
        )

    def runtime(self, stage: str) -> StageRuntime:
        if stage not in STAGES:
            raise KeyError(f"unknown stage {stage!r}")
        return getattr(self, stage)

    def group_of(self, stage: str) -> str | None:
        return next((g.name for g in self.resource_groups if stage in g.stages), None)

    @classmethod
    def uniform(cls, device: str = "cpu", dtype: str = "float32", mode: str = "in-process") -> Placement:
        """Every stage on ``[device]`` with world size 1 (three separate, equal runtimes)."""
        return cls(mode, *(StageRuntime((device,), 1, dtype, stage=s) for s in STAGES))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Placement:
        if not isinstance(data, Mapping):
            raise ValueError(f"a placement must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"mode", *STAGES, "resource_groups", "call_timeout"})
        if unknown:
            raise ValueError(f"placement: unknown key(s) {unknown} (allowed: mode, {', '.join(STAGES)}, resource_groups, "
                             f"call_timeout)")
        if data.get("mode", "in-process") not in MODES:  # before the stages: a bad mode alone blamed stage 'encode'
            raise ValueError(f"placement mode must be one of {list(MODES)}, got {data['mode']!r}")
        missing = [s for s in STAGES if s not in data]
        if missing:
            raise ValueError(
                f"stage {missing[0]!r}: the placement gives no runtime for it (every stage needs its own; "
                "there is no fallback between stages)"
            )
        groups = []
        for item in data.get("resource_groups", ()) or ():
            if not isinstance(item, Mapping) or set(item) - {"name", "max_concurrency", "stages"}:
                raise ValueError(f"resource group must be {{name, max_concurrency, stages}}, got {item!r}")
            groups.append(ResourceGroupDecl(item.get("name"), item.get("max_concurrency", 1), item.get("stages", ())))
        runtimes = [StageRuntime.from_dict(s, data[s]) for s in STAGES]
        return cls(data.get("mode", "in-process"), *runtimes, resource_groups=groups,
                   call_timeout=data.get("call_timeout", DEFAULT_CALL_TIMEOUT))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, **{s: self.runtime(s).as_dict() for s in STAGES},
                               "call_timeout": self.call_timeout}
        if self.resource_groups:
            out["resource_groups"] = [
                {"name": g.name, "max_concurrency": g.max_concurrency, "stages": list(g.stages)} for g in self.resource_groups
            ]
        return out


def load_placement(source: Placement | Mapping[str, Any] | str | Path) -> Placement:
    """A :class:`Placement` from itself, a dict, inline JSON text (starting with ``{``) or a JSON file path."""
    if isinstance(source, Placement):
        return source
    if isinstance(source, Mapping):
        return Placement.from_dict(source)
    if not isinstance(source, str | Path):
        raise ValueError(f"placement must be a Placement, a dict, JSON text or a file path, got {source!r}")
    text, where = placement_text(str(source))
    try:
        data = json.loads(text, object_pairs_hook=refuse_repeated_keys)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None
    except RepeatedKey as exc:
        raise ValueError(f"{where} names {exc.key!r} twice in one object (which one holds?)") from None
    except RecursionError:  # a ValueError like any bad placement: a refused configuration, not a crash to restart
        raise ValueError(f"{where} is nested too deep to be a placement") from None
    try:
        return Placement.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def pipeline_spec(placement: Placement) -> PipelineSpec:
    """The toy world graph with exactly the resource groups the placement declares (none by default)."""
    group = placement.group_of
    return PipelineSpec(
        stages=(
            StageSpec("encode", {"encode_request"}, {"condition"}, resource_group=group("encode")),
            StageSpec("denoise", {"condition", "control"}, {"latent"}, resource_group=group("denoise")),
            StageSpec("decode", {"latent"}, {"frames"}, resource_group=group("decode")),
        ),
        edges=(
            EdgeSpec("encode_request", "encode", None, 2),
            EdgeSpec("condition", "denoise", "encode", 2),
            EdgeSpec("control", "denoise", None, 2),
            EdgeSpec("latent", "decode", "denoise", 2),
        ),
        output_artifacts={"frames"},
        output_capacity_per_session=2,
        resource_groups=tuple(ResourceGroupSpec(g.name, g.max_concurrency) for g in placement.resource_groups),
        latency_anchor_artifact="control",
    )
