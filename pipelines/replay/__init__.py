"""``pipelines/replay``: a server-push example pipeline (a test pattern or a video file, with a tone).

``chunkline run pipelines/replay --chunks 3`` streams it offline; the stream server serves it as a
server-push pipeline. See :mod:`pipelines.replay.service` for the options.
"""

from __future__ import annotations

from .service import ANY_FILE, ReplayOptions, ReplayService

__all__ = ["ReplayOptions", "ReplayService", "get_service"]


def get_service(gpu_num: int = 0, *, served: bool = False, assets_dir: str | None = None) -> ReplayService:
    """The replay service; it uses no accelerator, so ``gpu_num`` is ignored. It takes nothing else: a ``--seed``,
    ``--device`` or placement given for it is refused (it has no randomness, no device and no stages to place).

    The stream server offers ``served`` and its ``assets_dir``: its clients are remote, so their
    ``video_path`` must name a file inside the assets directory (and none without one); a local run
    (``chunkline run``) may name any file."""
    return ReplayService(gpu_num=gpu_num, videos=assets_dir if served else ANY_FILE)
