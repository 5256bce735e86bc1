"""``chunkline run`` keeps its exit code when a daemon thread is still inside native code as the process ends (a stage
call past its ``call_timeout`` is left on its thread; a pipeline may leave daemon threads running).

The interpreter's last teardown under such a thread aborted: ``terminate called without an active exception``,
killed by SIGABRT (exit 134) after the run had said it failed, exit 1 (an in-process toy world with a short
``call_timeout`` did so one run in two).
"""

from __future__ import annotations

from pathlib import Path

from .cli_runs import failed_line, run_pipeline


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
    ran = run_pipeline(tmp_path, PIPELINE)
    assert ran.stderr.splitlines() == [  # no "terminate called without an active exception"
        "chunkline run: the run failed: pipeline bug: create_session raised RuntimeError: no session today"
    ], ran.stderr[-2000:]
    assert failed_line(ran) == ran.lines[0]  # exit 1 (it was 134), nothing left
