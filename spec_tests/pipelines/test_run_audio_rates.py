"""Audio at a sample rate the mp4's AAC cannot take fails ``chunkline run`` naming the rate, leaving nothing.

It failed the run as ``ArgumentError: Invalid argument: 'avcodec_open2("aac", {})' returned 22``, naming neither the
audio nor its rate.
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

from pipelines.contract import Audio, Chunk


class Sounding(MinimalService):
    async def chunks(self, session_id):
        for index in range(self.chunk_count):
            audio = Audio(bytes(2 * {rate} // 4), sample_rate={rate})
            yield Chunk(index, np.zeros((2, 8, 8, 3), np.uint8), 8.0, audio=audio)


def get_service(gpu_num=0):
    return Sounding()
"""


@pytest.mark.parametrize("rate", [12345, 192000])
def test_an_audio_rate_aac_cannot_take_fails_the_run_naming_it(tmp_path: Path, rate: int) -> None:
    path = tmp_path / "p.py"
    path.write_text(PIPELINE.format(rate=rate))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(path), "--chunks", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL)
    lines = [line for line in done.stderr.splitlines() if not re.match(r"\d+/\d+ chunks ", line)]  # not progress
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("chunkline run: the run failed: "), lines
    assert f"chunk 0: audio sample_rate {rate} Hz cannot be encoded as AAC (it takes 7350, 8000, " in lines[0]
    assert done.returncode == 1
    assert not out.exists()

