"""An error a pipeline raises while making a chunk fails ``chunkline run`` naming the chunk, whatever its type.

A ``ValueError`` out of ``chunks()`` read ``the pipeline failed making chunk 2: ValueError: ...``, but any other
error read only ``the run failed: KeyError: 'k'`` (or ``OSError: disk gone``), naming neither the chunk nor that it
came from the pipeline's stream. Now each is a :class:`pipelines.offline.ChunkFailed` naming both (exit 1, nothing
written), through ``run_offline`` and a real ``chunkline run``.
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

from pipelines.contract import Chunk, ServerPushService, SessionConfig
from pipelines.offline import ChunkFailed, PipelineCallError, run_offline
from server.run_command import run_deadlines

from .minimal_service import MinimalService
from .offline_helpers import files_in

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import its pipeline and fail
DEADLINES = run_deadlines()


class RaisesFirst(ServerPushService):
    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    async def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        raise OSError("disk gone")
        yield Chunk(0, np.zeros((2, 8, 8, 3), np.uint8), 8.0)


@pytest.mark.parametrize(
    ("service", "told"),
    [(MinimalService(chunks=2, then=KeyError("k")), "the pipeline failed making chunk 2: KeyError: 'k'"),
     (MinimalService(chunks=1, then=ValueError("no")), "the pipeline failed making chunk 1: ValueError: no"),
     (RaisesFirst(), "pipeline bug: stream() raised OSError: disk gone before its first chunk")],
    ids=["key_error", "value_error", "server_push_os_error"],
)
async def test_an_error_making_a_chunk_names_the_chunk(service: Any, told: str, tmp_path: Path) -> None:
    """A server-push stream's first chunk is its session's setup: an error there is named as a create's is."""
    with pytest.raises((ChunkFailed, PipelineCallError)) as failed:
        await run_offline(service, SessionConfig(), None, 4, tmp_path, deadlines=DEADLINES)
    assert str(failed.value) == told
    assert files_in(tmp_path) == []


def test_chunkline_run_names_the_chunk_the_pipeline_failed_making(tmp_path: Path) -> None:
    pipeline = tmp_path / "raises.py"
    pipeline.write_text("from spec_tests.pipelines.minimal_service import MinimalService\n\n"
                        "def get_service(gpu_num=0):\n"
                        "    return MinimalService(chunks=2, then=KeyError('k'))\n")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(pipeline), "--chunks", "4", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == "chunkline run: the run failed: the pipeline failed making chunk 2: KeyError: 'k'", done.stderr
    assert not out.exists()
