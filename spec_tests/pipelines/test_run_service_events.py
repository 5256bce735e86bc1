"""A ``ServiceEvent`` whose type is not text is the pipeline's bug, named where it is made.

``chunkline run`` took it, made every chunk, and then failed the finished run in Python's words, naming neither the
event nor whose bug it was (``TypeError: '<' not supported between instances of 'str' and 'int'`` sorting the events
for ``metrics.json``; ``keys must be str, int, float, bool or None, not tuple`` writing it); the server's runner failed
on ``event.type.startswith``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import its pipeline and fail

PIPELINE = """\
from pipelines.contract import ServiceEvent
from spec_tests.pipelines.minimal_service import MinimalService


class Telling(MinimalService):
    async def create_session(self, config, *, on_event=None):
        on_event(ServiceEvent("s0", "warming_up"))
        on_event(ServiceEvent("s0", {kind}))
        return "s0"


def get_service(gpu_num=0):
    return Telling()
"""


@pytest.mark.parametrize(("kind", "shown"), [("5", "5"), ("('lease', 'granted')", "('lease', 'granted')")])
def test_an_event_type_that_is_not_text_fails_the_run_as_the_pipeline_s_bug(tmp_path: Path, kind: str,
                                                                             shown: str) -> None:
    path = tmp_path / "p.py"
    path.write_text(PIPELINE.format(kind=kind))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(path), "--chunks", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL)
    assert done.stderr.splitlines() == [
        f"chunkline run: the run failed: pipeline bug: a ServiceEvent's type must be text, got {shown}"
    ], done.stderr[-2000:]
    assert done.returncode == 1
    assert not out.exists()
