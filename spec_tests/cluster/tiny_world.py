"""A tiny toy world for agent tests: 32x48, 2 frames per chunk, up to four retained sessions per agent (the authority sets fewer)."""

from pipelines.toy_world import ToyWorldConfig, ToyWorldService


def get_service(gpu_num: int = 0, **_: object) -> ToyWorldService:
    return ToyWorldService(ToyWorldConfig(height=32, width=48, frames_per_chunk=2), max_sessions=4)
