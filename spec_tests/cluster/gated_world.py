"""The tiny toy world, loaded only once a test opens its gate: it makes ``$GATED_WORLD/loading`` as it starts to
load, then waits (a minute at most) until ``$GATED_WORLD/open`` exists, so a test can act while the agent loads."""

import os
import time
from pathlib import Path

from pipelines.toy_world import ToyWorldConfig, ToyWorldService


def get_service(gpu_num: int = 0, **_: object) -> ToyWorldService:
    gate = Path(os.environ["GATED_WORLD"])
    (gate / "loading").touch()
    give_up = time.monotonic() + 60.0
    while not (gate / "open").exists() and time.monotonic() < give_up:
        time.sleep(0.05)  # bench-cost: the pipeline's own load, held by the test (another process)
    return ToyWorldService(ToyWorldConfig(height=32, width=48, frames_per_chunk=2), max_sessions=4)
