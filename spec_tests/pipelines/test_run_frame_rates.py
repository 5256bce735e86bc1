"""Chunks at a frame rate the mp4 cannot hold fail ``chunkline run`` naming the fps, leaving nothing.

Below 1/2002 fps the video's rate rounded to 0, the encoder took 24 fps instead, and the run exited 0 with a video at
the wrong speed beside a ``metrics.json`` saying the chunks' fps; 1e10 fps failed it as ``OverflowError: value too large
to convert to int``, naming nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_runs import failed_line, run_pipeline


PIPELINE = """\
from spec_tests.pipelines.minimal_service import MinimalService

import numpy as np

from pipelines.contract import Chunk


class AtRate(MinimalService):
    async def chunks(self, session_id):
        for index in range(self.chunk_count):
            yield Chunk(index, np.zeros((2, 8, 8, 3), np.uint8), {fps!r})


def get_service(gpu_num=0):
    return AtRate()
"""


@pytest.mark.parametrize(("fps", "shown"), [(1e-7, "1e-07"), (1e10, "1e+10")], ids=["too_slow", "too_fast"])
def test_an_fps_the_video_cannot_hold_fails_the_run_naming_it(tmp_path: Path, fps: float, shown: str) -> None:
    line = failed_line(run_pipeline(tmp_path, PIPELINE.format(fps=fps)))
    assert line.startswith("chunkline run: the run failed: "), line
    assert f"chunk 0: fps {shown} cannot be the video's frame rate (it takes 1/1001 to 1000000" in line
