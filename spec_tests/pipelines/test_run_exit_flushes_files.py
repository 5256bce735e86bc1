"""What a pipeline wrote to a file it left open is in the file once ``chunkline run`` ends, though a thread of its own
still runs then.

With a thread besides the main one alive at the end, the command ends after its exit calls without the interpreter's
teardown (``server.stray_threads``: a daemon thread in native code aborted that teardown), and the teardown is what
flushes the file objects still open: the lines a pipeline had written to its own log file, in its buffer, were lost.
"""

from __future__ import annotations

from pathlib import Path

from .cli_runs import run_pipeline

PIPELINE = """\
import threading
from contextlib import asynccontextmanager

from spec_tests.pipelines.minimal_service import MinimalService

LOG = open({log!r}, "w")  # left open, never flushed: a few lines stay in its buffer
RAW = open({raw!r}, "wb")


class Logging(MinimalService):
    @asynccontextmanager
    async def running(self):
        threading.Thread(target=threading.Event().wait, daemon=True).start()  # still running at the end
        LOG.write("running\\n")
        yield
        LOG.write("done\\n")
        RAW.write(b"bytes")


def get_service(gpu_num=0):
    return Logging()
"""


def test_a_file_the_pipeline_left_open_holds_what_it_wrote_after_the_run(tmp_path: Path) -> None:
    log, raw = tmp_path / "pipeline.log", tmp_path / "pipeline.bin"
    ran = run_pipeline(tmp_path, PIPELINE.format(log=str(log), raw=str(raw)))
    assert ran.code == 0, ran.stderr[-2000:]
    assert log.read_text() == "running\ndone\n"
    assert raw.read_bytes() == b"bytes"


BLOCKED_WRITER = """\
import os
import threading
from contextlib import asynccontextmanager

from spec_tests.pipelines.minimal_service import MinimalService

_, WRITE_END = os.pipe()  # a pipe nobody reads: a write past its buffer blocks for ever, holding the file's lock
PIPE = os.fdopen(WRITE_END, "wb")


class Blocked(MinimalService):
    @asynccontextmanager
    async def running(self):
        threading.Thread(target=PIPE.write, args=(b"x" * 10_000_000,), daemon=True).start()
        yield


def get_service(gpu_num=0):
    return Blocked()
"""


def test_a_file_locked_by_a_thread_blocked_writing_to_it_does_not_hold_the_end(tmp_path: Path) -> None:
    # bench-cost: the end waits out its 2 s bound on flushing the file the blocked thread holds
    ran = run_pipeline(tmp_path, BLOCKED_WRITER)
    assert ran.code == 0, ran.stderr[-2000:]
    assert (ran.out / "video.mp4").is_file()
