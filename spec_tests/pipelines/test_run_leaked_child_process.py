"""A child process the pipeline started with ``multiprocessing`` and left running does not hold ``chunkline run``'s
end: after the grace threads get, one line names it as the pipeline's bug, it is ended, and the run keeps its code.

multiprocessing's exit call joined it for ever: a run that had written its output never ended, deaf to Ctrl-C, and a
SIGTERM ended it with 143, leaving the child running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to start its pipeline's child, run, wait 3 s and end it

PIPELINE = """\
import multiprocessing
import signal
from pathlib import Path

from spec_tests.pipelines.minimal_service import MinimalService


def get_service(gpu_num=0):
    child = multiprocessing.get_context("spawn").Process(target=signal.pause, name="leaky-child")
    child.start()  # never stopped: signal.pause waits for ever
    Path({pid_file!r}).write_text(str(child.pid))
    return MinimalService()
"""


def _run_leaving(tmp_path: Path, pipeline: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """``chunkline run`` of ``pipeline`` (its text, with ``{pid_file}`` for where it writes the pids it leaves), which
    succeeds and writes its output; what it said, and the pid file's text."""
    path = tmp_path / "p.py"
    pid_file = tmp_path / "left.pid"
    path.write_text(pipeline.format(pid_file=str(pid_file)))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(path), "--chunks", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["metrics.json", "video.mp4"]
    return done, pid_file.read_text()


def test_a_child_process_left_running_is_named_and_ended_and_the_run_keeps_its_code(tmp_path: Path) -> None:
    done, pid = _run_leaving(tmp_path, PIPELINE)
    assert ("chunkline run: pipeline bug: 1 process(es) it started still run ('leaky-child'), not daemon processes, "
            "3 s after it closed: Python would wait for them for ever; ending them") in done.stderr
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        pass  # ended, and reaped
    else:
        raise AssertionError("the pipeline's child process still runs")


PROGRAMS = """\
import subprocess
from pathlib import Path

from spec_tests.pipelines.minimal_service import MinimalService


def get_service(gpu_num=0):
    plain = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL)  # never stopped
    own_session = subprocess.Popen(["sleep", "301"], stdin=subprocess.DEVNULL, start_new_session=True)
    Path({pid_file!r}).write_text(f"{{plain.pid}} {{own_session.pid}}")
    return MinimalService()
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_a_program_the_pipeline_started_and_left_running_is_named_and_ended(tmp_path: Path) -> None:
    """A tool the pipeline ran with ``subprocess.Popen`` (in a session of its own, too) and never stopped outlived
    ``chunkline run``, nothing said: it is named as the pipeline's bug once the threads' grace is over, and ended;
    the run keeps its code."""
    done, left = _run_leaving(tmp_path, PROGRAMS)
    pids = [int(pid) for pid in left.split()]
    try:
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith("chunkline run: pipeline bug: 2 process(es) it started still run ("), done.stderr[-2000:]
        assert all(f"'sleep' (pid {pid})" in line for pid in pids), line
        assert not [pid for pid in pids if _running(pid)]
    finally:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


FORKED = """\
import contextlib
import multiprocessing
import signal
from pathlib import Path

from spec_tests.pipelines.minimal_service import MinimalService


def fork():
    child = multiprocessing.get_context("fork").Process(target=signal.pause, name="forked-child")
    child.start()  # never stopped; a fork of the run, its signal handlers included
    Path({pid_file!r}).write_text(str(child.pid))


class ForksInRunning(MinimalService):
    @contextlib.asynccontextmanager
    async def running(self):
        fork()
        async with super().running():
            yield


def get_service(gpu_num=0):
    if {in_running}:
        return ForksInRunning()
    fork()
    return MinimalService()
"""


@pytest.mark.parametrize("in_running", [False, True], ids=["forked-loading", "forked-running"])
def test_a_forked_child_ended_at_the_end_does_not_say_the_run_was_stopped(tmp_path: Path, in_running: bool) -> None:
    """A forked child has the command's signal handlers: ended with SIGTERM, one forked while the pipeline loaded
    printed a ``StopSignalled`` traceback, one forked in ``running()`` said ``SIGTERM received, stopping the run``
    after the run had succeeded, as if the user had stopped it. It dies by the signal, saying nothing."""
    done, pid = _run_leaving(tmp_path, FORKED.replace("{in_running}", str(in_running)))
    assert "received, stopping the run" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "chunkline run: pipeline bug: 1 process(es) it started still run ('forked-child')"), done.stderr[-2000:]
    assert not _running(int(pid))


BEHIND_A_SHELL = """\
import os
from pathlib import Path

from spec_tests.pipelines.minimal_service import MinimalService


def get_service(gpu_num=0):
    os.system("sleep 302 < /dev/null > /dev/null 2>&1 & echo $! > {pid_file}")  # the shell exits at once
    return MinimalService()
"""


def test_a_tool_left_in_the_background_through_a_shell_is_named_and_ended(tmp_path: Path) -> None:
    """``os.system("tool &")``: the tool lost its parent as the shell exited, went to init, and outlived the run, not
    named (and held a caller's pipe open). The run adopts its orphans: it is named and ended as a ``Popen``'s is."""
    done, left = _run_leaving(tmp_path, BEHIND_A_SHELL)
    pid = int(left.strip())
    try:
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith("chunkline run: pipeline bug: 1 process(es) it started still run ("), done.stderr[-2000:]
        assert f"'sleep' (pid {pid})" in line, line
        assert not _running(pid)
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
