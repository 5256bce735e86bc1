"""``chunkline run`` keeps its exit code when a daemon thread is still inside native code as the process ends (a stage
call past its ``call_timeout`` is left on its thread; a pipeline may leave daemon threads running).

The interpreter's last teardown under such a thread aborted: ``terminate called without an active exception``,
killed by SIGABRT (exit 134) after the run had said it failed, exit 1 (an in-process toy world with a short
``call_timeout`` did so one run in two).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import torch and its pipeline, fail and exit

PIPELINE = """\
from contextlib import asynccontextmanager

import torch

from engine.threads import DedicatedThread
from spec_tests.pipelines.minimal_service import MinimalService


def spin():
    left = torch.ones(512, 512)
    while True:
        torch.mm(left, left)


class Busy(MinimalService):
    @asynccontextmanager
    async def running(self):
        thread = DedicatedThread("busy-stage")
        thread.start()
        thread.submit(spin, (), lambda result: None)  # never ends, as a stage call left past its call_timeout
        yield

    async def create_session(self, config, *, on_event=None):
        raise RuntimeError("no session today")


def get_service(gpu_num=0):
    return Busy()
"""


def test_a_thread_busy_in_torch_at_the_end_leaves_the_exit_code_as_the_run_said(tmp_path: Path) -> None:
    path = tmp_path / "p.py"
    path.write_text(PIPELINE)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(path), "--chunks", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL)
    assert done.stderr.splitlines() == [
        "chunkline run: the run failed: pipeline bug: create_session raised RuntimeError: no session today"
    ], done.stderr[-2000:]
    assert done.returncode == 1
    assert not out.exists()
