"""``metrics.json`` is valid JSON and a finished run succeeds whatever numbers the chunks' metadata brings.

A stage time of 1e308 s in a few chunks failed the finished run (exit 1, ``OverflowError: intermediate overflow in
fsum``, naming nothing), and idle seconds summing past a float's range were written as ``Infinity``, which JSON
parsers refuse, while the run exited 0.
"""

from __future__ import annotations

import json
from pathlib import Path

from .cli_runs import run_pipeline
from typing import NoReturn


PIPELINE = """\
from spec_tests.pipelines.minimal_service import MinimalService

import numpy as np

from pipelines.contract import Chunk


class Huge(MinimalService):
    async def chunks(self, session_id):
        for index in range(self.chunk_count):
            metadata = {"stage_times": {"denoise": 1e308},
                        "idle_reasons": [{"reason": "lease_wait", "idle_seconds": 1e308}]}
            yield Chunk(index, np.zeros((2, 8, 8, 3), np.uint8), 8.0, metadata=metadata)


def get_service(gpu_num=0):
    return Huge()
"""


def _no_constant(name: str) -> NoReturn:
    raise AssertionError(f"metrics.json holds {name}, which is not JSON")


def test_huge_stage_and_idle_seconds_leave_a_finished_run_and_a_valid_metrics_json(tmp_path: Path) -> None:
    ran = run_pipeline(tmp_path, PIPELINE, chunks=3)
    assert ran.code == 0, ran.stderr[-2000:]
    out = ran.out
    metrics = json.loads((out / "metrics.json").read_text(), parse_constant=_no_constant)
    assert metrics["stage_times"] == {"denoise": {"count": 3, "mean_seconds": 1e308}}
    assert metrics["idle_reasons"] == {"lease_wait": {"count": 3, "idle_seconds": None}}
    assert (out / "video.mp4").is_file()
