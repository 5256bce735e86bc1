"""Chunks at a frame rate the mp4 cannot hold fail ``chunkline run`` naming the fps, leaving nothing.

Below 1/2002 fps the video's rate rounded to 0, the encoder took 24 fps instead, and the run exited 0 with a video at
the wrong speed beside a ``metrics.json`` saying the chunks' fps; 1e10 fps failed it as ``OverflowError: value too large
to convert to int``, naming nothing.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import its pipeline and make 2 small chunks

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
    path = tmp_path / "p.py"
    path.write_text(PIPELINE.format(fps=fps))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(path), "--chunks", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL)
    lines = [line for line in done.stderr.splitlines() if not re.match(r"\d+/\d+ chunks ", line)]  # not progress
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("chunkline run: the run failed: "), lines
    assert f"chunk 0: fps {shown} cannot be the video's frame rate (it takes 1/1001 to 1000000" in lines[0]
    assert done.returncode == 1
    assert not out.exists()
