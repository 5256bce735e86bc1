"""Build the authority with the launcher ``--workers`` names (local, ray, external)."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from .authority import ClusterAuthority

if TYPE_CHECKING:
    from ..runtime import StreamRuntime

__all__ = ["make_authority"]


def make_authority(runtime: StreamRuntime) -> ClusterAuthority:
    """The authority for ``runtime.settings.workers``; local and ray make a cluster token when none is set."""
    settings = runtime.settings
    token = settings.cluster_token or secrets.token_urlsafe(32)
    groups = settings.worker_gpu_map or tuple(() for _ in range(settings.num_workers))
    if settings.workers == "local":
        from .launch_local import LocalLauncher

        return ClusterAuthority(runtime, LocalLauncher(groups, policy=runtime.restart_policy), token=token)
    if settings.workers == "ray":
        from .launch_ray import RayLauncher

        return ClusterAuthority(runtime, RayLauncher(groups, address=settings.ray_address, policy=runtime.restart_policy), token=token)
    return ClusterAuthority(runtime, None, token=token)
