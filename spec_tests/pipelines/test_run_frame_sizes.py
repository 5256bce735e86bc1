"""Frames larger than the video takes (past 16384 pixels a side) fail ``chunkline run`` naming their size.

They failed it as ``ExternalError: Generic error in an external library: 'avcodec_open2("libx264", ...)'``, naming
neither the frames nor their size.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import its pipeline and make 2 narrow chunks

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
    path = tmp_path / "p.py"
    path.write_text(PIPELINE.format(height=height, width=width))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(path), "--chunks", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL)
    lines = [line for line in done.stderr.splitlines() if not re.match(r"\d+/\d+ chunks ", line)]  # not progress
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("chunkline run: the run failed: "), lines
    assert (f"chunk 0: frames of {width} x {height} pixels are larger than the video takes (at most 16384 per side)"
            in lines[0])
    assert done.returncode == 1
    assert not out.exists()
