"""A pipeline that puts handlers of its own on the stop signals (``signal.signal`` in its ``running()``) does not make
``chunkline stream-serve``, or hypercorn's trio worker, deaf to them: the server puts its own back and says so once.

Before, a SIGTERM reached only the pipeline's handler: the server went on serving, without a word of why the stop
was not heard (a service manager then killed it: no drain). In a real process, through a real signal.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from ..reliability.test_held_loop_stops import Server

PIPELINE = """\
import signal
from contextlib import asynccontextmanager

from pipelines.toy_world.service import ToyWorldConfig, ToyWorldService


class TakesSignals(ToyWorldService):
    @asynccontextmanager
    async def running(self):
        async with super().running() as running:
            signal.signal(signal.SIGTERM, lambda number, frame: None)  # a handler of its own, that stops nothing
            yield running


def get_service(gpu_num=0, **options):
    return TakesSignals(ToyWorldConfig(height=32, width=48, frames_per_chunk=2), max_sessions=4)
"""
EXIT_DEADLINE = 30.0


@pytest.mark.parametrize("command", [
    ["-m", "server.cli", "stream-serve", "{pipeline}", "--port", "0"],
    # hypercorn's one process (its trio worker, where the app runs in the main thread and so may set handlers)
    ["-m", "hypercorn", "--worker-class", "trio", "--workers", "0", "--bind", "127.0.0.1:0", "server:app"],
], ids=["stream-serve", "hypercorn-trio"])
def test_a_pipeline_that_replaces_the_stop_handlers_does_not_make_the_server_deaf(
    tmp_path: Path, command: list[str]
) -> None:
    pipeline = tmp_path / "takes_signals.py"
    pipeline.write_text(PIPELINE)
    server = Server([arg.format(pipeline=pipeline) for arg in command], pipeline=str(pipeline))
    try:
        server.ready()
        server.until(re.compile(rb"pipeline bug: the pipeline replaced the server's SIGTERM handler; the server put "
                                rb"its own back"), EXIT_DEADLINE)
        server.popen.send_signal(signal.SIGTERM)
        assert server.popen.wait(timeout=EXIT_DEADLINE) == 0, server.log.decode(errors="replace")
    finally:
        server.end()
