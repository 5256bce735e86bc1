"""A relative ``--out`` is where ``chunkline run`` writes, even when the pipeline changes the working directory (model
code that moves into its own folder to find its weights).

The run wrote ``video.mp4`` and ``metrics.json`` under the pipeline's new working directory, left the ``--out`` it
had made empty, said ``video out/video.mp4`` and exited 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import its pipeline and make 2 small chunks

PIPELINE = """\
import os

from spec_tests.pipelines.minimal_service import MinimalService


def get_service(gpu_num=0):
    os.chdir({elsewhere!r})
    return MinimalService()
"""


def test_a_relative_out_holds_the_output_after_the_pipeline_changed_directory(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = tmp_path / "p.py"
    path.write_text(PIPELINE.format(elsewhere=str(elsewhere)))
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", "p.py", "--chunks", "2", "--out", "out"],
                          cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=RUN_DEADLINE,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "out")) == ["metrics.json", "video.mp4"]
    assert os.listdir(elsewhere) == []
    assert f"video             {tmp_path / 'out' / 'video.mp4'}" in done.stdout.splitlines()
