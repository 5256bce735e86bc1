"""A tiny toy world whose stream shows what the server offered it: its fps is ``fps``, and each chunk holds
``control_idle_timeout`` frames (so a test reads both settings off the startup check and the chunks)."""

from pipelines.toy_world import ToyWorldConfig, ToyWorldService


def get_service(gpu_num: int = 0, *, fps: float = 16.0, control_idle_timeout: float = 10.0) -> ToyWorldService:
    config = ToyWorldConfig(height=32, width=48, frames_per_chunk=round(control_idle_timeout), fps=fps)
    return ToyWorldService(config, max_sessions=2, control_idle_timeout=control_idle_timeout)
