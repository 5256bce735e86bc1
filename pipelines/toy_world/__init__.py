"""The toy world pipeline: a small, real torch world model served as a BidirectionalService.

``get_service(gpu_num=0, device=None, seed=0, **sizes)`` builds it; sizes are the
fields of :class:`ToyWorldConfig` (height, width, frames_per_chunk, ...).
"""

from __future__ import annotations

from typing import Any

from .model import ToyWorldConfig
from .service import ToyWorldService

__all__ = ["get_service", "ToyWorldConfig", "ToyWorldService"]


def get_service(
    gpu_num: int = 0,
    *,
    device: str | None = None,
    seed: int = 0,
    max_sessions: int = 4,
    idle_timeout: float = 10.0,
    **sizes: Any,
) -> ToyWorldService:
    if device is None:
        device = f"cuda:{gpu_num}" if gpu_num and _cuda_available() else "cpu"
    config = ToyWorldConfig(device=device, seed=seed, **sizes)
    return ToyWorldService(config, max_sessions=max_sessions, idle_timeout=idle_timeout)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
