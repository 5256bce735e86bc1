"""``chunkline run`` takes from a chunk what a served session takes: the server's check of its metadata.

A chunk whose metadata a served session refuses (``stage_times`` that is not a mapping of stage name to seconds)
failed every session under the server as the pipeline's bug, and ``chunkline run`` wrote it into its video and
exited 0: one pipeline, two verdicts.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from server.cli import main

PIPELINE = textwrap.dedent('''
    from contextlib import asynccontextmanager

    import numpy as np

    from pipelines.contract import Chunk, ServerPushService


    class Stream(ServerPushService):
        takes_prompt = takes_image = False

        @asynccontextmanager
        async def running(self):
            yield self

        async def stream(self, config):
            for index in range(4):
                yield Chunk(index, np.zeros((2, 16, 16, 3), np.uint8), 8.0, metadata={"stage_times": [0.1, 0.2]})


    def get_service(gpu_num=0):
        return Stream()
''')


def test_a_chunk_whose_metadata_a_served_session_refuses_fails_the_run_as_the_pipeline_s_bug(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pipeline = tmp_path / "listed_stage_times.py"
    pipeline.write_text(PIPELINE)
    out = tmp_path / "out"
    assert main(["run", str(pipeline), "--chunks", "2", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "pipeline bug: chunk 0's metadata key 'stage_times' is a list, not a mapping of stage name to seconds" in err
    assert not (out / "video.mp4").exists()
