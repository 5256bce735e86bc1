"""A pipeline author's mistakes in the service contract, as ``chunkline run`` and the startup check tell them.

Each is told with what was wrong and where, at load time where it can be (``running()`` written as a
plain ``async def``: a pipeline bug, exit code 1, as every mistake of the pipeline's is), else when it happens (a chunk that is not a ``Chunk``, frames that are not uint8, chunk
indexes that skip, a session id that is not a string: a pipeline bug, exit code 1; a teardown hook that fails
the warm-up session's close after a good chunk).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.loader import PipelineLoadError, load_service
from pipelines.validation import PipelineValidationError, validate_service
from server.cli import main
from server.stray_threads import STRAY_THREAD_GRACE

from .minimal_service import MinimalService

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import its pipeline and fail


def pipeline_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "author_pipeline.py"
    path.write_text(
        "from spec_tests.pipelines.minimal_service import MinimalService\n\n"
        f"{body}\n\n"
        "def get_service(gpu_num=0):\n"
        "    return Broken()\n"
    )
    return str(path)


RUNNING_COROUTINE = """
class Broken(MinimalService):
    async def running(self):
        return None
"""

RUNNING_GENERATOR = """
class Broken(MinimalService):
    async def running(self):
        yield
"""

CHUNKS_COROUTINE = """
class Broken(MinimalService):
    async def chunks(self, session_id):
        return []
"""


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (RUNNING_COROUTINE, "running() is an 'async def'; it must return an async context manager"),
        (RUNNING_GENERATOR, "@contextlib.asynccontextmanager"),
        (CHUNKS_COROUTINE, "chunks() is an 'async def' without 'yield'"),
    ],
    ids=["running_coroutine", "running_async_generator", "chunks_coroutine"],
)
def test_a_contract_method_of_the_wrong_kind_is_refused_at_load_naming_it(
    body: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = pipeline_file(tmp_path, body)
    with pytest.raises(PipelineLoadError, match="Broken in") as refused:
        load_service(path)
    assert named in str(refused.value)
    out = tmp_path / "out"
    assert main(["run", path, "--chunks", "2", "--out", str(out)]) == 1  # the pipeline's bug, not the user's input
    err = capsys.readouterr().err
    assert err.startswith(f"chunkline run: the run failed: pipeline bug: Broken in {path!r}: "), err
    assert named in err and "RuntimeWarning" not in err and "never awaited" not in err
    assert not out.exists()


def test_a_chunk_that_is_not_a_chunk_fails_the_run_naming_what_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = pipeline_file(
        tmp_path, "class Broken(MinimalService):\n    def __init__(self):\n        super().__init__(dict_chunks=True)"
    )
    out = tmp_path / "out"
    assert main(["run", path, "--chunks", "2", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "the pipeline yielded a dict as chunk 0, not a pipelines.contract.Chunk" in err
    assert not (out / "video.mp4").exists() and not (out / "metrics.json").exists()


FLOAT_FRAMES = """
class Broken(MinimalService):
    async def chunks(self, session_id):
        import numpy as np
        from pipelines.contract import Chunk
        yield Chunk(0, np.zeros((2, 8, 8, 3), np.float32), 8.0)
"""

SKIPPED_INDEX = """
class Broken(MinimalService):
    async def chunks(self, session_id):
        import numpy as np
        from pipelines.contract import Chunk
        for index in (0, 2, 3):
            yield Chunk(index, np.zeros((2, 8, 8, 3), np.uint8), 8.0)
"""

INT_SESSION_ID = """
class Broken(MinimalService):
    async def create_session(self, config, *, on_event=None):
        return 7
"""


@pytest.mark.parametrize(
    ("body", "told"),
    [
        (FLOAT_FRAMES, "pipeline bug: chunk frames must be uint8, got float32"),
        (SKIPPED_INDEX, "pipeline bug: chunk indexes must run 0, 1, 2, ... in order; chunk 1 of the stream has index 2"),
        (INT_SESSION_ID, "pipeline bug: create_session returned int 7, not a session id (a non-empty str)"),
    ],
    ids=["float_frames", "skipped_index", "int_session_id"],
)
def test_a_chunk_or_session_id_that_breaks_the_contract_is_a_pipeline_failure_not_bad_input(
    body: str, told: str, tmp_path: Path
) -> None:
    """Exit code 1 (a run that failed), not 2 (the user's input): the user cannot fix a pipeline's bug."""
    path = pipeline_file(tmp_path, body)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", path, "--chunks", "3", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == f"chunkline run: the run failed: {told}", done.stderr[-2000:]
    assert "Warning" not in done.stderr, done.stderr[-2000:]
    assert not out.exists()


async def test_a_failing_teardown_after_a_good_warm_up_chunk_is_told_as_the_close() -> None:
    service = MinimalService(close_fails=True)
    async with service.running():
        with pytest.raises(PipelineValidationError) as failed:
            await validate_service(service, timeout=10)
    assert str(failed.value) == "closing the warm-up session failed: RuntimeError: teardown failed"


LEFT_THREAD = """
import threading
from contextlib import asynccontextmanager


class Broken(MinimalService):
    @asynccontextmanager
    async def running(self):
        never = threading.Event()  # nothing sets it: the thread outlives the pipeline
        threading.Thread(target=never.wait, name="author-poller").start()
        yield
"""


def test_a_thread_the_pipeline_never_stops_does_not_hold_the_run_s_exit(tmp_path: Path) -> None:
    """Python waits at exit for every non-daemon thread, deaf to signals: the run wrote its output and never ended."""
    path = pipeline_file(tmp_path, LEFT_THREAD)
    out = tmp_path / "out"
    # bench-cost: the stray thread gets STRAY_THREAD_GRACE (3 s) of real time to end before the run ends without it
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", path, "--chunks", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE)
    assert done.returncode == 0, done.stderr[-2000:]  # the run itself succeeded: its output stays
    assert (out / "video.mp4").is_file() and (out / "metrics.json").is_file()
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("chunkline run: pipeline bug: 1 thread(s) it started still run ('author-poller'), "
                           "not daemon threads"), done.stderr[-2000:]
    assert "start them as daemon threads" in last


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_once_the_run_has_said_its_summary_changes_nothing(tmp_path: Path, number: int) -> None:
    """The run is over, its output written and its summary said, and the command waits for a thread its pipeline
    left (up to 3 s) before it ends: a Ctrl-C there printed a ``KeyboardInterrupt`` traceback and a SIGTERM killed
    the process by the signal (-15), for a run that had succeeded. It is noted and changes nothing: the status
    is the run's."""
    path = pipeline_file(tmp_path, LEFT_THREAD)
    out = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-m", "server.cli", "run", path, "--chunks", "2", "--out", str(out)],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        summary = run.stdout.readline()  # type: ignore[union-attr]  # the summary's first line: the run is over
        assert summary, run.stderr.read()  # type: ignore[union-attr]
        # into the end's real-time wait of STRAY_THREAD_GRACE (3 s) for the pipeline's thread, which the command says
        # nothing as it enters: the rest of the summary (one write) and the way to the command's end take
        # milliseconds, and the wait begins right after; a signal in the middle of it has half of it to spare on each
        # side, however slow the host (a signal as the summary is written is the run's, and ends it with 128 + n)
        time.sleep(STRAY_THREAD_GRACE / 2)  # bench-cost: lands in the middle of that real-time wait
        assert run.poll() is None, run.communicate()  # still in the wait: the signal reaches the command's end
        run.send_signal(number)
        _, stderr = run.communicate(timeout=RUN_DEADLINE)
    finally:
        run.kill()
    assert run.returncode == 0, (run.returncode, stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-2000:]
    assert (out / "video.mp4").is_file() and (out / "metrics.json").is_file()


LONG_ERROR = """
class Broken(MinimalService):
    async def create_session(self, config, *, on_event=None):
        raise RuntimeError("a tensor's repr: " + "0.5, " * 20_000)
"""


def test_a_pipeline_error_of_100_kb_is_told_in_a_line_cut_short_saying_how_much_was_left_out(tmp_path: Path) -> None:
    """A pipeline's error of 100 KB (a tensor's repr, a whole config) was told as one line of 100 KB, burying the rest
    of the terminal: the line holds its first 2,000 characters and says how many more there were."""
    path = pipeline_file(tmp_path, LONG_ERROR)
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", path, "--chunks", "2", "--out",
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("chunkline run: the run failed: pipeline bug: create_session raised RuntimeError: a tensor's "
                           "repr: 0.5, 0.5,"), last[:300]
    assert last.endswith(" more characters)") and len(last) < 2300, (len(last), last[-200:])
