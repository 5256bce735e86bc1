"""A pipeline that blocks trio's thread past a deadline fails ``chunkline run`` naming the call, exit 1.

The run's deadlines are trio cancel scopes, which act only when the pipeline gives the loop back: a ``time.sleep``
or a busy loop in ``create_session``, ``push_control`` or while making a chunk held the run for ever. A watchdog
thread (:mod:`pipelines.loop_watch`) now notices the loop that does not answer past the deadline and ends the run
in one line, leaving nothing. The deadlines are the server's constants, shortened to a second in the process.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ..processes import end_popen
from .cli_runs import ROOT, default_signals, failed_line, last_line, one_control, read_stderr_until, run_pipeline

PIPELINE = """\
import time

from spec_tests.pipelines.minimal_service import MinimalService

WHERE = {where!r}


def block():
    if WHERE.endswith("busy"):
        while True:
            pass
    time.sleep(3600)  # bench-cost: the blocking call under test, in the pipeline; the run never waits it out


class Blocks(MinimalService):
    async def create_session(self, config, *, on_event=None):
        if WHERE.startswith("create_session"):
            block()
        return "s0"

    async def push_control(self, session_id, control):
        if WHERE.startswith("push_control"):
            block()

    async def chunks(self, session_id):
        async for chunk in super().chunks(session_id):
            if WHERE.startswith("chunks") and chunk.index == 1:
                block()
            yield chunk


def get_service(gpu_num=0):
    return Blocks()
"""

SHORT = {"CREATE_PIPELINE_TIMEOUT": 1.0, "CONTROL_TIMEOUT": 1.0, "CHUNK_STALL_TIMEOUT": 1.0}


@pytest.mark.parametrize(
    ("where", "late"),
    [
        ("create_session-sleep", "create_session did not return within 1 s"),
        ("push_control-busy", "push_control did not return within 1 s"),
        ("chunks-sleep", "chunks() did not give chunk 1 within 1 s"),
    ],
)
def test_a_pipeline_blocking_trio_s_thread_past_its_deadline_fails_the_run_naming_the_call(
    tmp_path: Path, where: str, late: str
) -> None:
    # bench-cost: the run waits out its real deadline (shortened to 1 s) and the watchdog's 2 s grace
    ran = run_pipeline(tmp_path, PIPELINE.format(where=where), *one_control(tmp_path), chunks=3, deadlines=SHORT)
    line = failed_line(ran)
    assert re.fullmatch(rf"chunkline run: the run failed: pipeline bug: {re.escape(late)}: it has blocked trio's "
                        r"thread for at least \d+ s \(code that never awaits, .*trio\.to_thread\.run_sync\)", line), line


def test_a_ctrl_c_while_a_pipeline_holds_trio_s_thread_ends_the_run_at_once_as_stopped(tmp_path: Path) -> None:
    """The user pressed Ctrl-C once while ``create_session`` blocked trio's thread. A stop in order needs that thread:
    the run waited out the call's whole deadline (60 s here; 600 s for a model loaded in ``running()``), then said
    ``the run failed``, exit 1. Now the stop looks at the loop at once: past the watchdog's 2 s grace the run ends 130
    (128 + the signal), naming the call that holds the loop and the code it is in. The call's deadline is the default 60 s: only the stop's
    own look can end it within the wait below."""
    path = tmp_path / "p.py"
    path.write_text(PIPELINE.format(where="create_session-sleep").replace(
        "            block()\n        return \"s0\"",
        "            sys.stderr.write('blocking the loop\\n')\n            sys.stderr.flush()\n            block()\n"
        "        return \"s0\"").replace("import time\n", "import sys\nimport time\n"))
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "run", str(path), "--chunks", "2", "--out", str(out)],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=default_signals)
    try:
        seen = read_stderr_until(process, lambda text: b"blocking the loop\n" in text, "the block", within=60.0)
        process.send_signal(signal.SIGINT)
        # bench-cost: the watchdog's 2 s grace in real time; the call's own 60 s deadline is past this wait
        assert process.wait(timeout=30.0) == 130
        last = last_line(process, seen)
        assert re.fullmatch(r"chunkline run: interrupted, and the stop met: pipeline bug: create_session \(p\.py, line "
                            r"\d+, in block\) has blocked trio's thread for at least \d+ s, so the run could not stop in order \(code that never "
                            r"awaits, .*\); no output was written", last), last
        assert not out.exists()
    finally:
        end_popen(process)
