"""Every wait of an offline run has a deadline, the server's own, and a pipeline's failure names the call.

A ``running()`` that never yields, a ``create_session`` that never returns, a server-push stream whose first chunk
never comes or a ``push_control`` that never returns held ``chunkline run`` for ever; past its deadline each is now
the pipeline's bug naming the call, and nothing is written. A ``close_session`` that hangs was cut after 10 s
without a word: the run keeps its output and says so. An error one of the calls raised read ``the run failed:
KeyError: 'nope'``, naming no call. The deadlines are the server's (60 s for a create, 600 s for entering
``running()``): run here on trio's autojump clock, through ``run_offline`` as ``chunkline run`` calls it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from pipelines.contract import Chunk, Control, ServerPushService, SessionConfig
from pipelines.offline import PipelineCallError, TimedControls, parse_timed_controls, run_offline
from server.cli import main
from server.run_command import run_deadlines

from ..processes import end_popen
from .cli_runs import default_signals, last_line, read_stderr_until
from .minimal_service import MinimalService
from .offline_helpers import files_in

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import its pipeline and fail
DEADLINES = run_deadlines()
ONE_CONTROL = parse_timed_controls([{"t": 0, "type": "control", "control": "w"}])


class HangsEntering(MinimalService):
    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        await trio.sleep_forever()
        yield


class HangsCreating(MinimalService):
    """Its running() holds a nursery, as an orchestrator's does: the deadline's scope must not end inside it."""

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            yield
            nursery.cancel_scope.cancel()

    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        await trio.sleep_forever()
        raise AssertionError("unreachable")


class HangsPushing(MinimalService):
    async def push_control(self, session_id: str, control: Control) -> None:
        await trio.sleep_forever()


class NoFirstChunk(ServerPushService):
    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    async def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        await trio.sleep_forever()
        yield Chunk(0, np.zeros((2, 8, 8, 3), np.uint8), 8.0)


@pytest.mark.parametrize(
    ("service", "controls", "told", "seconds"),
    [
        (HangsEntering(), None, "pipeline bug: running() did not return within 600 s", 600),
        (HangsCreating(), None, "pipeline bug: create_session did not return within 60 s", 60),
        (NoFirstChunk(), None, "pipeline bug: stream() gave no first chunk within 60 s", 60),
        (HangsPushing(), ONE_CONTROL, "pipeline bug: push_control did not return within 15 s", 15),
    ],
    ids=["running", "create_session", "first_server_push_chunk", "push_control"],
)
async def test_a_call_that_never_returns_fails_the_run_at_the_server_s_deadline_naming_it(
    service: Any, controls: TimedControls | None, told: str, seconds: float, tmp_path: Path, autojump_clock: Any
) -> None:
    with pytest.raises(PipelineCallError) as failed, trio.fail_after(3600):  # the test's own bound, far past the run's
        await run_offline(service, SessionConfig(), controls, 3, tmp_path, deadlines=DEADLINES)
    assert str(failed.value) == told
    assert trio.current_time() == pytest.approx(seconds)
    assert files_in(tmp_path) == []


class HangsClosing(MinimalService):
    async def close_session(self, session_id: str) -> None:
        self.closed.append(session_id)
        await trio.sleep_forever()


async def test_a_close_that_never_returns_is_cut_and_the_complete_run_keeps_its_output_with_a_warning(
    tmp_path: Path, autojump_clock: Any
) -> None:
    service = HangsClosing()
    summary = await run_offline(service, SessionConfig(), None, 3, tmp_path, deadlines=DEADLINES)
    assert summary.chunks == 3 and service.closed == ["s0"]
    assert summary.warnings == ("pipeline bug: close_session did not return within 10 s",)
    assert files_in(tmp_path) == ["metrics.json", "video.mp4"]


class RaisesEntering(MinimalService):
    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        raise KeyError("nope")
        yield


class RaisesCreating(MinimalService):
    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        raise KeyError("nope")


class RaisesLeaving(MinimalService):
    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield
        raise LookupError("gone")


class HangsLeaving(MinimalService):
    """Its teardown never ends (a closer waiting on what never comes); ``create_fails``: its create raises first."""

    def __init__(self, create_fails: bool = False) -> None:
        super().__init__()
        self.create_fails = create_fails

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await trio.sleep_forever()

    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        if self.create_fails:
            raise KeyError("nope")
        return await super().create_session(config, on_event=on_event)


async def test_leaving_running_that_never_ends_is_cut_and_the_complete_run_keeps_its_output_with_a_warning(
    tmp_path: Path, autojump_clock: Any
) -> None:
    """Leaving ``running()`` had no deadline: a run whose every chunk came waited for ever, and the Ctrl-C that ended
    it wrote nothing. It is cut at the close deadline, as a close is."""
    # (no bound of the test's own here: the autojump clock would jump to it while the run writes on a thread)
    summary = await run_offline(HangsLeaving(), SessionConfig(), None, 3, tmp_path, deadlines=DEADLINES)
    assert summary.chunks == 3
    assert summary.warnings == ("pipeline bug: leaving running() did not return within 10 s",)
    assert trio.current_time() == pytest.approx(10)
    assert files_in(tmp_path) != []
    # a run that failed inside still fails with its own error, once leaving was cut
    with pytest.raises(PipelineCallError, match="create_session raised KeyError"), trio.fail_after(3600):
        await run_offline(HangsLeaving(create_fails=True), SessionConfig(), None, 3, tmp_path / "failed",
                          deadlines=DEADLINES)


@pytest.mark.parametrize(
    ("service", "told"),
    [
        (RaisesEntering(), "pipeline bug: running() raised KeyError: 'nope'"),
        (RaisesCreating(), "pipeline bug: create_session raised KeyError: 'nope'"),
        (MinimalService(close_fails=True), "pipeline bug: close_session raised RuntimeError: teardown failed"),
        (RaisesLeaving(), "pipeline bug: leaving running() raised LookupError: gone"),
    ],
    ids=["running", "create_session", "close_session", "leaving_running"],
)
async def test_an_error_a_call_raises_is_the_pipeline_s_bug_naming_the_call(
    service: Any, told: str, tmp_path: Path
) -> None:
    with pytest.raises(PipelineCallError) as failed:
        await run_offline(service, SessionConfig(), None, 2, tmp_path, deadlines=DEADLINES)
    assert str(failed.value) == told
    assert files_in(tmp_path) == []


async def test_a_refusal_of_the_request_is_not_named_a_bug(tmp_path: Path) -> None:
    """A ValueError from create_session refuses the request (an option): exit 2 under ``chunkline run``, as before."""

    class Refuses(MinimalService):
        async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
            raise ValueError("option 'speed' must be > 0")

    with pytest.raises(ValueError, match="option 'speed'") as refused:
        await run_offline(Refuses(), SessionConfig(), None, 2, tmp_path, deadlines=DEADLINES)
    assert not isinstance(refused.value, PipelineCallError)


def pipeline_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "deadline_pipeline.py"
    path.write_text(
        "import trio\n"
        "from spec_tests.pipelines.minimal_service import MinimalService\n\n"
        f"{body}\n\n"
        "def get_service(gpu_num=0):\n"
        "    return Broken()\n"
    )
    return str(path)


def test_chunkline_run_names_the_call_that_raised_exit_1_nothing_written(tmp_path: Path) -> None:
    path = pipeline_file(tmp_path, "class Broken(MinimalService):\n"
                                   "    async def create_session(self, config, *, on_event=None):\n"
                                   "        raise KeyError('nope')\n")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", path, "--chunks", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == "chunkline run: the run failed: pipeline bug: create_session raised KeyError: 'nope'", done.stderr
    assert not out.exists()


def test_chunkline_run_warns_of_a_close_it_cut_and_exits_0_with_the_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = pipeline_file(tmp_path, "class Broken(MinimalService):\n"
                                   "    async def close_session(self, session_id):\n"
                                   "        await trio.sleep_forever()\n")
    out = tmp_path / "out"
    # bench-cost: the close is cut at the run's real 10 s deadline; no setting lowers it
    assert main(["run", path, "--chunks", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == ("chunkline run: warning: pipeline bug: close_session did not return "
                                            "within 10 s"), err
    assert files_in(out) == ["metrics.json", "video.mp4"]


def test_a_stop_during_a_close_that_never_returns_says_the_stop_met_it(tmp_path: Path) -> None:
    """Ctrl-C while the pipeline's close hangs: the stop waits for the close up to its deadline, as it must, and then
    said only ``interrupted; no output was written``, though the close it waited for was the pipeline's bug (a run
    left alone warns of it). It says what the stop met, as a stop that met a blocked loop does."""
    path = pipeline_file(tmp_path, "import sys\n\n"
                                   "class Broken(MinimalService):\n"
                                   "    async def close_session(self, session_id):\n"
                                   "        sys.stderr.write('closing\\n')\n"
                                   "        sys.stderr.flush()\n"
                                   "        await trio.sleep_forever()\n")
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys, server.run_command as run\nrun.CLOSE_TIMEOUT = 1.0\n"
         "from server.cli import main\nsys.exit(main())\n", "run", path, "--chunks", "2", "--out", str(out)],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=default_signals)
    try:
        seen = read_stderr_until(process, lambda text: b"closing\n" in text, "the close")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=RUN_DEADLINE) == 130  # bench-cost: the close's shortened 1 s deadline, real time
        last = last_line(process, seen)
        assert last == ("chunkline run: interrupted, and the stop met: pipeline bug: close_session did not return "
                        "within 1 s; no output was written"), last
        assert not out.exists()
    finally:
        end_popen(process)
