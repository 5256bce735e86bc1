"""A pipeline that puts handlers of its own on the stop signals (``signal.signal`` in its ``running()``, as some
libraries do) does not make ``chunkline run`` deaf to them: the run puts its own back and says so once.

Before, a Ctrl-C or a SIGTERM reached only the pipeline's handler: the run went on to its end (or for ever), without
a word of why the stop was not heard. In a real process, through real signals.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ..processes import end_popen
from .cli_runs import ROOT, default_signals, last_line, read_stderr_until

PIPELINE = """\
import signal
from contextlib import asynccontextmanager

import numpy as np
import trio

from pipelines.contract import ServerPushService, Chunk


class TakesSignals(ServerPushService):
    takes_prompt = False
    takes_image = False

    @asynccontextmanager
    async def running(self):
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, lambda number, frame: None)  # a handler of its own, that stops nothing
        yield self

    async def stream(self, config):
        for index in range(100000):
            yield Chunk(index, np.zeros((1, 8, 8, 3), np.uint8), 8.0)
            await trio.sleep(0.05)  # bench-cost: a paced stream the signal stops


def get_service(gpu_num=0):
    return TakesSignals()
"""


@pytest.mark.parametrize(("number", "words"),
                         [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated (SIGTERM)")],
                         ids=["SIGINT", "SIGTERM"])
def test_a_pipeline_that_replaces_the_stop_handlers_does_not_make_the_run_deaf(tmp_path: Path, number: int,
                                                                                words: str) -> None:
    pipeline = tmp_path / "p.py"
    pipeline.write_text(PIPELINE)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "server.cli", "run", str(pipeline), "--chunks", "100000", "--out", str(out)]
    process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, preexec_fn=default_signals)
    try:
        name = signal.Signals(number).name
        warned = (f"chunkline run: warning: pipeline bug: the pipeline replaced the run's {name} handler; the run put "
                  f"its own back (a stop signal stops the run in order)").encode()
        seen = read_stderr_until(process, lambda said: warned in said, "the warning")
        process.send_signal(number)
        seen = read_stderr_until(process, lambda said: b"stopping the run" in said, "the stop", seen)
        assert process.wait(timeout=30) == 128 + number
        assert last_line(process, seen) == f"chunkline run: {words}; no output was written"
        assert seen.count(warned) == 1
    finally:
        end_popen(process)
