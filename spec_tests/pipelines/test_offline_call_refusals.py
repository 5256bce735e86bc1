"""Which of the pipeline's calls may refuse: a ``ValueError`` out of ``push_control`` or a close is its bug.

A ``ValueError`` passes ``chunkline run`` as the pipeline refusing the request (exit 2, its own words), right for
``create_session`` (an option it does not take). ``push_control`` refuses a control with a ``ControlRejected`` (the
run records it and goes on); any other ``ValueError`` out of it, a bug such as ``int('abc')``, ended the run with
exit 2 and only ``invalid literal for int() with base 10: 'abc'``, naming neither the call nor whose bug it was. A
close refuses nothing: a ``ValueError`` from ``close_session`` exited 2 the same way after a complete run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.contract import Control, ControlRejected, PipelineContractError, SessionConfig
from pipelines.offline import PipelineCallError, run_offline
from pipelines.timed_controls import parse_timed_controls
from server.run_command import run_deadlines

from .minimal_service import MinimalService

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import its pipeline and fail
CONTROLS = parse_timed_controls([{"t": 0, "type": "control_state", "controls": ["w"]}])


class PushFails(MinimalService):
    def __init__(self, error: Exception) -> None:
        super().__init__(chunks=4)
        self.error = error

    async def push_control(self, session_id: str, control: Control) -> None:
        raise self.error


async def test_a_value_error_out_of_push_control_is_the_pipeline_s_bug_naming_the_call(tmp_path: Path) -> None:
    with pytest.raises(PipelineCallError) as failed:
        await run_offline(PushFails(ValueError("invalid literal")), SessionConfig(), CONTROLS, 2, tmp_path,
                          deadlines=run_deadlines())
    assert str(failed.value) == "pipeline bug: push_control raised ValueError: invalid literal"


async def test_a_control_rejected_is_still_a_refusal_the_run_records(tmp_path: Path) -> None:
    summary = await run_offline(PushFails(ControlRejected("no")), SessionConfig(), CONTROLS, 2, tmp_path,
                                deadlines=run_deadlines())
    assert summary.metrics["controls"]["rejected"] == 1


class CloseFails(MinimalService):
    async def close_session(self, session_id: str) -> None:
        raise ValueError("bad handle")


async def test_a_value_error_out_of_close_session_is_the_pipeline_s_bug_naming_the_call(tmp_path: Path) -> None:
    with pytest.raises(PipelineContractError) as failed:
        await run_offline(CloseFails(chunks=4), SessionConfig(), None, 2, tmp_path, deadlines=run_deadlines())
    assert str(failed.value) == "pipeline bug: close_session raised ValueError: bad handle"


def test_chunkline_run_exits_1_naming_push_control(tmp_path: Path) -> None:
    pipeline = tmp_path / "p.py"
    pipeline.write_text("from spec_tests.pipelines.test_offline_call_refusals import PushFails\n\n"
                        "def get_service(gpu_num=0):\n    return PushFails(ValueError('bad key'))\n")
    controls = tmp_path / "controls.json"
    controls.write_text('[{"t": 0, "type": "control_state", "controls": ["w"]}]')
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(pipeline), "--chunks", "2", "--controls",
                           str(controls), "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_DEADLINE)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "chunkline run: the run failed: pipeline bug: push_control raised ValueError: bad key"), done.stderr[-2000:]
    assert not out.exists()
