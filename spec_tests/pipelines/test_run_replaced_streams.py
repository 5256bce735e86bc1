"""A pipeline that replaces ``sys.stdout`` or ``sys.stderr`` (``sys.stdout = None``, a buffer of its own) does not take
the run's own lines with it: ``chunkline run`` puts them back for its summary (on stdout) and the line that says how
the run ended (on stderr), and says so once. The summary went nowhere, and a failure's line too. In a real process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .cli_runs import ROOT, RUN_DEADLINE

PIPELINE = """\
import io
import sys

from spec_tests.pipelines.minimal_service import MinimalService


class Replacing(MinimalService):
    async def create_session(self, config, *, on_event=None):
        {replace}
        return "s0"


def get_service(gpu_num=0):
    return Replacing({then})
"""


@pytest.mark.parametrize(("replace", "replaced"), [
    ("sys.stdout = None", "sys.stdout"),
    ("sys.stdout = io.StringIO()", "sys.stdout"),
    ("sys.stdout = sys.stderr = io.StringIO()", "sys.stdout and sys.stderr"),
], ids=["none", "a-buffer", "both"])
@pytest.mark.parametrize("ends", ["done", "failed"])
def test_a_pipeline_that_replaces_the_runs_streams_does_not_take_its_lines(
        tmp_path: Path, replace: str, replaced: str, ends: str) -> None:
    pipeline = tmp_path / "p.py"
    then = "chunks=1, then=RuntimeError('broke')" if ends == "failed" else ""  # the second chunk fails
    pipeline.write_text(PIPELINE.format(replace=replace, then=then))
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(pipeline), "--chunks", "2", "--out",
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE,
                          stdin=subprocess.DEVNULL)
    warning = (f"chunkline run: warning: pipeline bug: the pipeline replaced {replaced}; the run put "
               f"{'them' if ' and ' in replaced else 'it'} back for its own lines")
    assert warning in done.stderr.splitlines(), done.stderr[-2000:]
    if ends == "done":
        assert done.returncode == 0, done.stderr[-2000:]
        assert "2 chunks" in done.stdout, (done.stdout, done.stderr[-2000:])  # the summary
    else:
        assert done.returncode == 1, done.stderr[-2000:]
        assert "chunkline run: the run failed: " in done.stderr and "broke" in done.stderr, done.stderr[-2000:]
