"""Frames larger than the video takes (past 16384 pixels a side) fail ``chunkline run`` naming their size.

They failed it as ``ExternalError: Generic error in an external library: 'avcodec_open2("libx264", ...)'``, naming
neither the frames nor their size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_runs import failed_line, run_pipeline


PIPELINE = """\
from spec_tests.pipelines.minimal_service import MinimalService

import numpy as np

from pipelines.contract import Chunk


class Wide(MinimalService):
    async def chunks(self, session_id):
        for index in range(self.chunk_count):
            yield Chunk(index, np.zeros((1, {height}, {width}, 3), np.uint8), 8.0)


def get_service(gpu_num=0):
    return Wide()
"""


@pytest.mark.parametrize(("height", "width"), [(2, 16386), (16400, 4)])
def test_frames_past_the_video_s_largest_side_fail_the_run_naming_their_size(tmp_path: Path, height: int,
                                                                              width: int) -> None:
    line = failed_line(run_pipeline(tmp_path, PIPELINE.format(height=height, width=width)))
    assert line.startswith("chunkline run: the run failed: "), line
    assert f"chunk 0: frames of {width} x {height} pixels are larger than the video takes (at most 16384 per side)" in line
