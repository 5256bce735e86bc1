"""The toy world pipeline: a small, real torch world model served as a BidirectionalService.

``get_service(gpu_num=0, device=None, seed=0, placement=None, **sizes)`` builds it; sizes are the
fields of :class:`ToyWorldConfig` (height, width, frames_per_chunk, ...). ``placement`` (a
:class:`Placement`, a dict, inline JSON or the path of a JSON placement file; format in
:mod:`pipelines.toy_world.placement`) says where each stage runs; without it every stage runs
in-process on ``device``. Giving both ``device`` and ``placement`` is refused (the placement names
every stage's devices). An impossible placement raises ``ValueError`` naming the stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .model import ToyWorldConfig
from .placement import Placement, StageRuntime, load_placement
from .service import PipelineFailed, ServiceFailedError, ToyWorldService

__all__ = [
    "PipelineFailed",
    "Placement",
    "ServiceFailedError",
    "StageRuntime",
    "ToyWorldConfig",
    "ToyWorldService",
    "get_service",
    "group_device",
    "load_placement",
]


def get_service(
    gpu_num: int = 0,
    *,
    gpu_ids: Sequence[int] = (),
    device: str | None = None,
    seed: int = 0,
    max_sessions: int = 4,
    control_idle_timeout: float = 10.0,
    rotate_lease: bool = False,
    fps: float | None = None,
    placement: Placement | Mapping[str, Any] | str | None = None,
    **sizes: Any,
) -> ToyWorldService:
    if placement is not None:
        if device is not None:
            raise ValueError("give either device or placement, not both (the placement names each stage's devices)")
        placement = load_placement(placement)
        device = placement.denoise.devices[0]
    if device is None:
        device = group_device(gpu_ids)
    if fps is not None:  # the server's --default-fps, unless the caller sized it explicitly
        sizes.setdefault("fps", fps)
    config = ToyWorldConfig(device=device, seed=seed, **sizes)
    return ToyWorldService(config, max_sessions=max_sessions, control_idle_timeout=control_idle_timeout,
                           rotate_lease=rotate_lease, placement=placement)


def group_device(gpu_ids: Sequence[int]) -> str:
    """The device of a worker's group: its first GPU, or the CPU when it has none or there is no CUDA.

    ``gpu_num`` is the size of the group, never a device index (a map ``0`` is ``cuda:0``)."""
    return f"cuda:{gpu_ids[0]}" if gpu_ids and _cuda_available() else "cpu"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
