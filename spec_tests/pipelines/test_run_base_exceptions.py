"""A pipeline that raises a ``BaseException`` of its own (``class Abort(BaseException)``, a ``GeneratorExit``) fails
``chunkline run`` in one line naming the call, exit code 1, as any other error of its does.

They went past every ``except Exception`` of the run and out of the command as a Python traceback (exit 1 by
Python's default, the call not named).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_runs import failed_line, one_control, run_pipeline


PIPELINE = """\
from contextlib import asynccontextmanager

import numpy as np

from pipelines.contract import BidirectionalService, Chunk

WHERE = {where!r}


class Abort(BaseException):
    pass


if WHERE == "import":
    raise Abort("at import")


class Service(BidirectionalService):
    @asynccontextmanager
    async def running(self):
        if WHERE == "running":
            raise Abort("in running")
        yield

    async def create_session(self, config, *, on_event=None):
        if WHERE == "create_session":
            raise Abort("in create_session")
        return "s0"

    async def push_control(self, session_id, control):
        if WHERE == "push_control":
            raise Abort("in push_control")

    async def chunks(self, session_id):
        for index in range(4):
            if index == 1 and WHERE == "chunks":
                raise Abort("in chunks")
            if index == 1 and WHERE == "generator_exit":
                raise GeneratorExit
            if index == 1 and WHERE == "group":
                raise BaseExceptionGroup("two at once", [GeneratorExit(), ZeroDivisionError("division by zero")])
            yield Chunk(index, np.zeros((1, 8, 8, 3), np.uint8), 8.0)

    async def close_session(self, session_id):
        if WHERE == "close_session":
            raise Abort("in close_session")


def get_service(gpu_num=0):
    if WHERE == "get_service":
        raise Abort("in get_service")
    return Service()
"""


@pytest.mark.parametrize(("where", "told"), [
    ("import", "pipeline bug: loading '{path}' raised Abort: at import"),
    ("get_service", "pipeline bug: loading '{path}' raised Abort: in get_service"),
    ("running", "pipeline bug: running() raised Abort: in running"),
    ("create_session", "pipeline bug: create_session raised Abort: in create_session"),
    ("push_control", "pipeline bug: push_control raised Abort: in push_control"),
    ("chunks", "the pipeline failed making chunk 1: Abort: in chunks"),
    ("close_session", "pipeline bug: close_session raised Abort: in close_session"),
    ("generator_exit", "pipeline bug: the pipeline raised GeneratorExit"),
    # the members named (it read "BaseExceptionGroup: two at once (2 sub-exceptions)", what was raised hidden)
    ("group", "pipeline bug: the pipeline raised BaseExceptionGroup: two at once (2 sub-exceptions): GeneratorExit; "
              "ZeroDivisionError: division by zero"),
])
def test_a_base_exception_the_pipeline_raises_is_one_line_naming_the_call(tmp_path: Path, where: str,
                                                                          told: str) -> None:
    ran = run_pipeline(tmp_path, PIPELINE.format(where=where), *one_control(tmp_path))
    assert failed_line(ran) == f"chunkline run: the run failed: {told.format(path=tmp_path / 'p.py')}"
