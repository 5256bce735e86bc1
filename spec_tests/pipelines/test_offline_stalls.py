"""A stream that gives a first chunk and then none fails ``chunkline run`` at the server's stall deadline.

A server-push stream's first chunk was bounded (the create's 60 s), but a chunk after it that never came held the
run for ever (and so did any chunk of a bidirectional session's ``chunks()``, which the run asks for one by one).
Each now has the server's ``CHUNK_STALL_TIMEOUT`` (``server.run_command.run_deadlines``): past it the run fails as
the pipeline's bug naming the stall and the chunk, and writes nothing. Through ``run_offline`` with the deadlines
``chunkline run`` gives it, on trio's autojump clock; and once as a ``chunkline run`` process, whose exit code and
line are checked with its deadline shortened to a second there (the same rule, as the process meets it).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from pipelines.contract import Chunk, ServerPushService, SessionConfig
from pipelines.offline import PipelineCallError, run_offline
from server.run_command import run_deadlines
from server.runner import CHUNK_STALL_TIMEOUT

from .minimal_service import MinimalService
from .offline_helpers import files_in

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import its pipeline and fail
DEADLINES = run_deadlines()


@pytest.fixture
def no_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The video writer's calls run inline: on the autojump clock a task waiting for a thread counts as blocked, and
    the clock would jump to the test's own bound while the writer works."""

    async def inline(fn: Any, *args: Any, **_: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", inline)


class StallsAfterFirst(ServerPushService):
    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    async def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        yield Chunk(0, np.zeros((2, 8, 8, 3), np.uint8), 8.0)
        await trio.sleep_forever()
        yield Chunk(1, np.zeros((2, 8, 8, 3), np.uint8), 8.0)


@pytest.mark.parametrize(
    ("service", "call", "given"),
    [(StallsAfterFirst(), "stream()", 1), (MinimalService(chunks=2, then="hang"), "chunks()", 2)],
    ids=["server_push", "bidirectional"],
)
async def test_a_stream_that_stalls_after_its_first_chunk_fails_the_run_at_the_server_s_stall_deadline(
    service: Any, call: str, given: int, tmp_path: Path, autojump_clock: Any, no_threads: None
) -> None:
    with pytest.raises(PipelineCallError) as failed, trio.fail_after(3600):  # the test's own bound, far past the run's
        await run_offline(service, SessionConfig(), None, given + 2, tmp_path, deadlines=DEADLINES)
    assert str(failed.value) == f"pipeline bug: {call} stalled: chunk {given} did not come within {CHUNK_STALL_TIMEOUT:g} s"
    assert trio.current_time() == pytest.approx(CHUNK_STALL_TIMEOUT)  # its chunks came at once
    assert files_in(tmp_path) == []


async def test_a_stream_whose_every_chunk_comes_within_the_deadline_is_not_cut(
    tmp_path: Path, autojump_clock: Any, no_threads: None
) -> None:
    class Slow(MinimalService):
        async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
            for index in range(3):
                await trio.sleep(CHUNK_STALL_TIMEOUT - 1)  # bench-cost: a chunk just inside the deadline, on the autojump clock
                yield Chunk(index, np.zeros((2, 8, 8, 3), np.uint8), 8.0)

    summary = await run_offline(Slow(), SessionConfig(), None, 3, tmp_path, deadlines=DEADLINES)
    assert summary.chunks == 3 and files_in(tmp_path) == ["metrics.json", "video.mp4"]


def test_chunkline_run_exits_1_naming_the_stall_and_writes_nothing(tmp_path: Path) -> None:
    pipeline = tmp_path / "stalls.py"
    pipeline.write_text(
        "import numpy as np, trio\n"
        "from contextlib import asynccontextmanager\n"
        "from pipelines.contract import Chunk, ServerPushService\n\n"
        "class Stalls(ServerPushService):\n"
        "    takes_prompt = takes_image = False\n"
        "    @asynccontextmanager\n"
        "    async def running(self):\n"
        "        yield\n"
        "    async def stream(self, config):\n"
        "        yield Chunk(0, np.zeros((2, 16, 16, 3), np.uint8), 8.0)\n"
        "        await trio.sleep_forever()\n"
        "        yield Chunk(1, np.zeros((2, 16, 16, 3), np.uint8), 8.0)\n\n"
        "def get_service(gpu_num=0):\n"
        "    return Stalls()\n"
    )
    # the command as `chunkline run` runs it, its stall deadline (the server's constant) shortened to 1 s here
    program = ("import sys, server.runner as runner; runner.CHUNK_STALL_TIMEOUT = 1.0\n"
               "from server.cli import main; sys.exit(main(sys.argv[1:]))\n")
    out = tmp_path / "out"
    # bench-cost: a real run waits out its real (shortened) 1 s stall deadline
    done = subprocess.run([sys.executable, "-c", program, "run", str(pipeline), "--chunks", "3", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == "chunkline run: the run failed: pipeline bug: stream() stalled: chunk 1 did not come within 1 s"
    assert not out.exists()
