"""A ``ControlRejected`` whose reason is not text is the pipeline's bug, named where it is raised.

``chunkline run`` recorded it, made every chunk, and then failed the finished run writing ``metrics.json`` in
Python's words (``TypeError: Object of type object is not JSON serializable``), naming neither the refusal nor whose
bug it was.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import its pipeline and fail

PIPELINE = """\
from pipelines.contract import ControlRejected
from spec_tests.pipelines.minimal_service import MinimalService


class Refusing(MinimalService):
    async def push_control(self, session_id, control):
        raise ControlRejected({"why": "busy"})


def get_service(gpu_num=0):
    return Refusing()
"""


def test_a_refusal_whose_reason_is_not_text_fails_the_run_as_the_pipeline_s_bug(tmp_path: Path) -> None:
    path = tmp_path / "p.py"
    path.write_text(PIPELINE)
    controls = tmp_path / "controls.json"
    controls.write_text('[{"t": 0, "type": "reset"}]')
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(path), "--chunks", "2", "--controls",
                           str(controls), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL)
    assert done.stderr.splitlines() == [
        "chunkline run: the run failed: pipeline bug: a ControlRejected's reason must be text, got {'why': 'busy'}"
    ], done.stderr[-2000:]
    assert done.returncode == 1
    assert not out.exists()
