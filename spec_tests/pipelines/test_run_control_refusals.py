"""A ``ControlRejected`` whose reason is not text is the pipeline's bug, named where it is raised.

``chunkline run`` recorded it, made every chunk, and then failed the finished run writing ``metrics.json`` in
Python's words (``TypeError: Object of type object is not JSON serializable``), naming neither the refusal nor whose
bug it was.
"""

from __future__ import annotations

from pathlib import Path

from .cli_runs import failed_line, one_control, run_pipeline


PIPELINE = """\
from pipelines.contract import ControlRejected
from spec_tests.pipelines.minimal_service import MinimalService


class Refusing(MinimalService):
    async def push_control(self, session_id, control):
        raise ControlRejected({"why": "busy"})


def get_service(gpu_num=0):
    return Refusing()
"""


def test_a_refusal_whose_reason_is_not_text_fails_the_run_as_the_pipeline_s_bug(tmp_path: Path) -> None:
    assert failed_line(run_pipeline(tmp_path, PIPELINE, *one_control(tmp_path))) == (
        "chunkline run: the run failed: pipeline bug: a ControlRejected's reason must be text, got {'why': 'busy'}")
