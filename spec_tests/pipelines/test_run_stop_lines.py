"""What ``chunkline run`` says when a stop signal ends it, in a real process: the same line whenever the signal
comes, only what happened, and SIGQUIT (Ctrl-\\) taken as a stop signal as SIGINT, SIGTERM and SIGHUP are.

A Ctrl-C in the command's first half second (as it imported what it runs) said only ``chunkline: interrupted``, naming
nothing it stopped, while one later said ``chunkline run: interrupted; no output was written``; a second Ctrl-C after
the stop had ended (the command still on its way out) said ``aborted by a second signal`` after the line that told
the stop's end; SIGQUIT met Python's default action (a core dump, exit -3), leaving the run's temporary files.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ..processes import end_popen
from .cli_runs import ROOT, RUN_DEADLINE, default_signals, read_stderr_until

EXIT_DEADLINE = 30.0  # seconds for a stopped run to end
REPLAY = str(ROOT / "pipelines" / "replay")

#: the command, with a stop signal sent to itself as it first imports ``sys.argv[1]`` (the word after ``-c``): a
#: signal at that moment of its start, without its timing
SIGNAL_AS_IT_IMPORTS = """\
import importlib.abc, os, sys
module, number = sys.argv.pop(1), int(sys.argv.pop(1))

class SignalOnce(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == module and self in sys.meta_path:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), number)
        return None

sys.meta_path.insert(0, SignalOnce())
from server.cli import main
sys.exit(main())
"""


def _signalled_as_it_imports(module: str, number: int, out: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", SIGNAL_AS_IT_IMPORTS, module, str(int(number)), "run", REPLAY, "--chunks", "1",
               "--out", str(out)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE,
                          stdin=subprocess.DEVNULL, preexec_fn=default_signals)


@pytest.mark.parametrize(("module", "number", "words"), [
    ("server.cli_parser", signal.SIGINT, "interrupted"),  # before its words are parsed
    ("pipelines.offline", signal.SIGINT, "interrupted"),  # as it imports what runs the pipeline
    ("pipelines.offline", signal.SIGTERM, "terminated (SIGTERM)"),
    ("pipelines.offline", signal.SIGQUIT, "quit (SIGQUIT)"),
], ids=["parsing-SIGINT", "importing-SIGINT", "importing-SIGTERM", "importing-SIGQUIT"])
def test_a_stop_signal_as_the_command_starts_says_what_it_stopped_as_a_later_one_does(
        tmp_path: Path, module: str, number: int, words: str) -> None:
    out = tmp_path / "out"
    result = _signalled_as_it_imports(module, number, out)
    assert result.returncode == 128 + number, result.stderr[-2000:]
    assert result.stderr.splitlines() == [f"chunkline run: {words}; no output was written"], result.stderr[-2000:]
    assert not out.exists()


def test_a_ctrl_c_as_the_command_starts_names_an_earlier_output_in_out_as_a_later_one_does(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "video.mp4").write_bytes(b"an earlier run's video")
    (out / "metrics.json").write_text("{}")
    result = _signalled_as_it_imports("pipelines.offline", signal.SIGINT, out)
    assert result.returncode == 130, result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        f"chunkline run: interrupted; no output was written (the earlier video.mp4 and metrics.json in {out} are an "
        f"earlier run's, unchanged)"], result.stderr[-2000:]
    assert (out / "video.mp4").read_bytes() == b"an earlier run's video"


#: a pipeline whose exit call never returns: once its run is over the command is on its way out for good, and a
#: signal then comes after the stop has ended (and said so)
HELD_EXIT = """\
import atexit
import sys
import threading

from spec_tests.pipelines.minimal_service import MinimalService

atexit.register(threading.Event().wait)


class Started(MinimalService):
    async def create_session(self, config, *, on_event=None):
        sys.stderr.write("created\\n")
        sys.stderr.flush()
        return "s0"


def get_service(gpu_num=0):
    return Started(then="hang")
"""


def _start(tmp_path: Path, pipeline: str) -> tuple[subprocess.Popen[bytes], Path]:
    path = tmp_path / "p.py"
    path.write_text(pipeline)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "server.cli", "run", str(path), "--chunks", "100000", "--out", str(out)]
    return subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, preexec_fn=default_signals), out


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGQUIT])
def test_a_second_signal_after_the_stop_ended_ends_the_command_saying_only_what_happened(tmp_path: Path,
                                                                                          first: int) -> None:
    process, out = _start(tmp_path, HELD_EXIT)
    try:
        seen = read_stderr_until(process, lambda text: b"created\n" in text, "the session")
        process.send_signal(first)
        seen = read_stderr_until(process, lambda text: b"no output was written\n" in text, "the stop's end", seen)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=EXIT_DEADLINE) == 128 + first
        assert process.stderr is not None
        seen += process.stderr.read()
    finally:
        end_popen(process)
    lines = [line for line in seen.decode().splitlines() if " chunks " not in line]
    name, words = signal.Signals(first).name, {signal.SIGINT: "interrupted", signal.SIGQUIT: "quit (SIGQUIT)"}[first]
    assert lines == ["created",
                     f"chunkline run: {name} received, stopping the run (press Ctrl-C again to abort at once)",
                     f"chunkline run: {words}; no output was written"], seen.decode()[-2000:]
    assert not out.exists()


def test_sigquit_stops_a_run_in_order_leaving_no_partial_file(tmp_path: Path) -> None:
    """Its default action (Ctrl-\\ on a terminal) dumped core: exit -3, its temporary video left in --out."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "server.cli", "run", REPLAY, "--chunks", "100000", "--option",
               "duration_seconds=86400", "--out", str(out)]
    process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, preexec_fn=default_signals)
    try:
        seen = read_stderr_until(process, lambda text: b"10/100000 chunks" in text, "progress")
        assert [path.name for path in out.iterdir() if path.name.endswith(".partial")], "it writes a temporary file"
        process.send_signal(signal.SIGQUIT)
        _, err = process.communicate(timeout=EXIT_DEADLINE)
    finally:
        end_popen(process)
    said = (seen + err).decode()
    assert process.returncode == 128 + signal.SIGQUIT, said[-2000:]
    assert "chunkline run: SIGQUIT received, stopping the run (press Ctrl-C again to abort at once)" in said
    assert said.rstrip().endswith("chunkline run: quit (SIGQUIT); no output was written"), said[-2000:]
    assert not out.exists()
