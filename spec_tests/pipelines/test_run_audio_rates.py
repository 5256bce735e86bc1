"""Audio at a sample rate the mp4's AAC cannot take fails ``chunkline run`` naming the rate, leaving nothing.

It failed the run as ``ArgumentError: Invalid argument: 'avcodec_open2("aac", {})' returned 22``, naming neither the
audio nor its rate.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_runs import failed_line, run_pipeline


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
    line = failed_line(run_pipeline(tmp_path, PIPELINE.format(rate=rate)))
    assert line.startswith("chunkline run: the run failed: "), line
    assert f"chunk 0: audio sample_rate {rate} Hz cannot be encoded as AAC (it takes 7350, 8000, " in line

