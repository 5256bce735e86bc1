"""The first Ctrl-C says at once that the run is stopping and that a second one aborts, even while the pipeline
blocks trio's thread (a blocking call in an ``async def``, as a model's synchronous load in ``create_session``).

The line was written from the trio loop, which such a pipeline holds: the user saw nothing after the first Ctrl-C,
and was not told that a second one aborts.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from ..processes import end_popen
from .cli_runs import default_signals, read_stderr_until

ROOT = Path(__file__).resolve().parents[2]
READ_DEADLINE = 60.0  # seconds for the child to import its pipeline
SAID_DEADLINE = 15.0  # seconds for the signal handler to say its line (it writes it at once)
EXIT_DEADLINE = 30.0

PIPELINE = """\
import sys
import threading

from spec_tests.pipelines.minimal_service import MinimalService


class Blocking(MinimalService):
    async def create_session(self, config, *, on_event=None):
        sys.stderr.write("blocking the loop\\n")
        sys.stderr.flush()
        threading.Event().wait()  # blocks trio's thread for ever; signal handlers still run
        return "s0"


def get_service(gpu_num=0):
    return Blocking()
"""


def test_the_first_ctrl_c_is_answered_at_once_while_the_pipeline_blocks_the_loop(tmp_path: Path) -> None:
    path = tmp_path / "p.py"
    path.write_text(PIPELINE)
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-m", "server.cli", "run", str(path), "--chunks", "2", "--out", str(out)],
                               cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               preexec_fn=default_signals)
    try:
        seen = read_stderr_until(process, lambda text: b"blocking the loop\n" in text, "the block",
                                 within=READ_DEADLINE)
        process.send_signal(signal.SIGINT)
        said = b"chunkline run: SIGINT received, stopping the run (press Ctrl-C again to abort at once)\n"
        seen = read_stderr_until(process, lambda text: said in text, "the stop's line", seen, SAID_DEADLINE)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=EXIT_DEADLINE) == 130
        assert process.stderr is not None
        seen += process.stderr.read()
        assert seen.decode().splitlines()[-1] == "chunkline run: aborted by a second signal; no output was written"
        assert not out.exists()
    finally:
        end_popen(process)
