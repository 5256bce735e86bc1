"""Every failure ``chunkline run`` tells is one line beginning ``chunkline run:``, whatever the pipeline's error says.

A message of several lines (``RuntimeError('no weights\\nlooked in ./w')``) was written as several, the ones after
the first without the prefix (a script reading the last line read ``looked in ./w``), and an error without words
ended its line in ``raised RuntimeError: ``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import its pipeline and fail

PIPELINE = """\
from spec_tests.pipelines.minimal_service import MinimalService


class Failing(MinimalService):
    async def {method}(self, *args, **kwargs):
        raise {error}{tail}


def get_service(gpu_num=0):
    return Failing()
"""


@pytest.mark.parametrize(("method", "error", "code", "told"), [
    ("create_session", "RuntimeError('no weights\\nlooked in ./w')", 1,
     "the run failed: pipeline bug: create_session raised RuntimeError: no weights looked in ./w"),
    ("create_session", "RuntimeError()", 1, "the run failed: pipeline bug: create_session raised RuntimeError"),
    ("create_session", "ValueError('option scene:\\n  must be one of a, b')", 2,
     "the pipeline refused the session: option scene: must be one of a, b"),
    ("chunks", "RuntimeError('decoder\\nfailed')", 1,
     "the run failed: the pipeline failed making chunk 0: RuntimeError: decoder failed"),
    ("chunks", "OSError()", 1, "the run failed: the pipeline failed making chunk 0: OSError"),
], ids=["lines", "no_words", "refusal_lines", "chunk_lines", "chunk_no_words"])
def test_a_pipeline_s_error_is_told_in_one_line(tmp_path: Path, method: str, error: str, code: int, told: str) -> None:
    path = tmp_path / "p.py"
    tail = "\n        yield" if method == "chunks" else ""  # chunks() is an async generator
    path.write_text(PIPELINE.format(method=method, error=error, tail=tail))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(path), "--chunks", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL)
    assert done.stderr.strip().splitlines() == [f"chunkline run: {told}"], done.stderr[-2000:]
    assert done.returncode == code
    assert not out.exists()


CHANGING = """\
import numpy as np

from pipelines.contract import Chunk
from spec_tests.pipelines.minimal_service import MinimalService


class Changing(MinimalService):
    async def chunks(self, session_id):
        for index in range(3):
            size, fps = ((8, 8), 8.0) if index < 2 else {changed}
            yield Chunk(index, np.zeros((2, *size, 3), np.uint8), fps)


def get_service(gpu_num=0):
    return Changing()
"""


@pytest.mark.parametrize(("changed", "told"), [
    ("((8, 8), 30.0)", "chunk 2 changes the fps from 8 to 30"),
    ("((6, 10), 8.0)", "chunk 2 changes the frame size from 8 x 8 to 10 x 6"),
])
def test_a_stream_that_changes_its_fps_or_frame_size_is_told_in_the_run_s_words(tmp_path: Path, changed: str,
                                                                                told: str) -> None:
    """A run writes one video, which keeps its first chunk's fps and size: a change failed the run in the encoder's
    words (``writing video.mp4 failed: ValueError: chunk 2: fps 30.0 changed from 8.0``)."""
    path = tmp_path / "p.py"
    path.write_text(CHANGING.format(changed=changed))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(path), "--chunks", "3", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"chunkline run: the run failed: {told}; a run's video.mp4 keeps the first chunk's fps, frame size and audio "
        f"format"), done.stderr[-2000:]
    assert not out.exists()
