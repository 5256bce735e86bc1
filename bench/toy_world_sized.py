"""The toy world at the frame size in ``CHUNKLINE_BENCH_SIZE`` (``WxH``, default 160x96).

A pipeline file for ``bench.livekit``, which serves it with the real command
(``chunkline stream-serve bench/toy_world_sized.py``) to measure the transports at several frame sizes.
"""

from __future__ import annotations

import os
from typing import Any

from pipelines import toy_world


def get_service(**options: Any) -> toy_world.ToyWorldService:
    width, height = (int(part) for part in os.environ.get("CHUNKLINE_BENCH_SIZE", "160x96").split("x"))
    return toy_world.get_service(width=width, height=height, **options)
