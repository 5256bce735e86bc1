"""Every failure of the pipeline's own fails ``chunkline run`` with a line that says ``pipeline bug:``, exit 1.

An error of a task the pipeline's ``running()`` started in its own nursery read ``the run failed: KeyError:
'background'``, naming neither whose bug it was nor where it came from; a server-push stream that failed before its
first chunk (its session's setup) read ``the run failed: the pipeline failed making chunk 0: KeyError: 'no first'``;
a pipeline that raised KeyboardInterrupt itself, no Ctrl-C given, exited 130 saying ``interrupted``, as if the user
had stopped it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_runs import failed_line, run_pipeline

TASK_FAILS = """\
from contextlib import asynccontextmanager

import trio

from spec_tests.pipelines.minimal_service import MinimalService


async def feed():
    await trio.lowlevel.checkpoint()
    raise KeyError("background")


class Feeding(MinimalService):
    @asynccontextmanager
    async def running(self):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            yield
            nursery.cancel_scope.cancel()

    async def create_session(self, config, *, on_event=None):
        if {waits!r} == "create_session":
            await trio.sleep_forever()  # cancelled as the task fails
        return "s0"

    async def chunks(self, session_id):
        await trio.sleep_forever()  # cancelled as the task fails
        yield


def get_service(gpu_num=0):
    return Feeding()
"""


@pytest.mark.parametrize("waits", ["create_session", "chunks"])
def test_an_error_of_a_task_running_started_is_the_pipeline_s_bug_naming_it(tmp_path: Path, waits: str) -> None:
    ran = run_pipeline(tmp_path, TASK_FAILS.format(waits=waits))
    assert failed_line(ran) == ("chunkline run: the run failed: pipeline bug: a task running() started raised "
                                "KeyError: 'background'")


SAYS_IT_FAILED = TASK_FAILS.replace(
    'async def feed():\n    await trio.lowlevel.checkpoint()\n    raise KeyError("background")',
    'FAILURE = []\n\n\nasync def feed():\n    await trio.lowlevel.checkpoint()\n'
    '    FAILURE.append("stage \'encode\' failed: rank 0 exited unexpectedly with code -9")\n'
    '    raise RuntimeError(FAILURE[0])',
).replace("class Feeding(MinimalService):\n", "class Feeding(MinimalService):\n"
          "    @property\n    def failure(self):\n        return FAILURE[0] if FAILURE else None\n\n")


def test_a_service_that_says_it_failed_is_told_in_its_words_not_as_a_bug(tmp_path: Path) -> None:
    """A service whose ``failure`` says why it failed as a whole (the toy world's, when a rank was killed from
    outside, by the OOM killer say) leaves ``running()`` with that error: it read ``pipeline bug: a task running()
    started raised ServiceFailedError: ...``, blaming the pipeline's author for a kill."""
    ran = run_pipeline(tmp_path, SAYS_IT_FAILED.format(waits="chunks"))
    assert "FAILURE" in SAYS_IT_FAILED and "def failure" in SAYS_IT_FAILED  # the replacements took
    assert failed_line(ran) == ("chunkline run: the run failed: stage 'encode' failed: rank 0 exited unexpectedly "
                                "with code -9")


PUSH_FAILS = """\
from contextlib import asynccontextmanager

import numpy as np

from pipelines.contract import Chunk, ServerPushService


class Pushes(ServerPushService):
    takes_prompt = takes_image = False

    @asynccontextmanager
    async def running(self):
        yield

    async def stream(self, config):
        raise KeyError("no first")
        yield Chunk(0, np.zeros((2, 16, 16, 3), np.uint8), 8.0)


def get_service(gpu_num=0):
    return Pushes()
"""


def test_a_server_push_stream_that_fails_before_its_first_chunk_is_the_pipeline_s_bug(tmp_path: Path) -> None:
    ran = run_pipeline(tmp_path, PUSH_FAILS)
    assert failed_line(ran) == ("chunkline run: the run failed: pipeline bug: stream() raised KeyError: 'no first' "
                                "before its first chunk")


INTERRUPTS = """\
from spec_tests.pipelines.minimal_service import MinimalService

WHERE = {where!r}


class Interrupts(MinimalService):
    async def create_session(self, config, *, on_event=None):
        if WHERE == "create_session":
            raise KeyboardInterrupt
        return "s0"

    async def chunks(self, session_id):
        async for chunk in super().chunks(session_id):
            if WHERE == "chunks" and chunk.index == 1:
                raise KeyboardInterrupt("from chunks")
            yield chunk


def get_service(gpu_num=0):
    if WHERE == "get_service":
        raise KeyboardInterrupt
    return Interrupts()
"""


@pytest.mark.parametrize(("where", "told"), [("get_service", "KeyboardInterrupt"),
                                             ("create_session", "KeyboardInterrupt"),
                                             ("chunks", "KeyboardInterrupt: from chunks")])
def test_a_keyboard_interrupt_the_pipeline_raises_without_a_signal_is_its_bug_exit_1(
    tmp_path: Path, where: str, told: str
) -> None:
    ran = run_pipeline(tmp_path, INTERRUPTS.format(where=where), chunks=3)
    assert failed_line(ran) == (f"chunkline run: the run failed: pipeline bug: {told} raised by the pipeline, though "
                                f"no Ctrl-C or other stop signal came")
