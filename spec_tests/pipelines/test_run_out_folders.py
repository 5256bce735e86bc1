"""``chunkline run --out`` folders that cannot hold a run's output, as a user meets them: a folder of the kernel's
own file systems (``/proc``, ``/sys``), and a folder another run is writing into at that moment. Each is refused
before the pipeline loads, in one line naming ``--out`` and the path, exit 2.

``--out /proc/self`` said ``no file can be written in it: No such file or directory`` of a folder that is there. Two
runs into one folder at once each renamed its ``video.mp4`` and then its ``metrics.json`` into place: their renames
could interleave, leaving one run's video beside the other's metrics, each run saying it succeeded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ..processes import end_popen
from .cli_runs import ROOT, RUN_DEADLINE, read_stderr_until

REPLAY = str(ROOT / "pipelines" / "replay")
EXIT_DEADLINE = 30.0  # seconds for a stopped run to end


def _noting_pipeline(tmp_path: Path) -> tuple[Path, Path]:
    """A pipeline file that notes it was imported (a file ``loaded`` beside it), and its note."""
    path, note = tmp_path / "noting_pipeline.py", tmp_path / "loaded"
    path.write_text(f"from pathlib import Path\nPath({str(note)!r}).touch()\n\ndef get_service(gpu_num=0):\n"
                    f"    raise RuntimeError('not to be reached')\n")
    return path, note


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", "run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="no /proc file system here")
@pytest.mark.parametrize("out", ["/proc/self", "/proc/self/fd", "/proc/self/made/here"])
def test_a_folder_of_the_proc_file_system_is_refused_saying_why(tmp_path: Path, out: str) -> None:
    pipeline, loaded = _noting_pipeline(tmp_path)
    result = _run(str(pipeline), "--chunks", "1", "--out", out)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        f"chunkline run: --out {out!r} cannot be an output folder: it is on the kernel's proc file system (/proc), "
        f"whose files the kernel makes itself, and no file of the run can be written there; give a folder on a "
        f"disk"], result.stderr[-2000:]
    assert not loaded.exists(), "the pipeline was loaded before --out was checked"


def _start_long_run(out: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "server.cli", "run", REPLAY, "--chunks", "100000", "--option",
               "duration_seconds=86400", "--out", str(out)]
    return subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def test_a_second_run_into_a_folder_a_running_one_writes_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = _start_long_run(out)
    try:
        read_stderr_until(first, lambda text: b"10/100000 chunks" in text, "progress")
        partial = [path.name for path in out.iterdir() if path.name.endswith(".partial")]
        assert partial, "the running run writes a temporary file"
        pipeline, loaded = _noting_pipeline(tmp_path)
        second = _run(str(pipeline), "--chunks", "1", "--out", str(out))
        assert second.returncode == 2, second.stderr[-2000:]
        assert second.stderr.splitlines() == [
            f"chunkline run: --out {str(out)!r} is the output folder of another chunkline run, still running: two "
            f"runs into one folder could leave one's video.mp4 beside the other's metrics.json; give this run a "
            f"folder of its own, or wait for that one to end"], second.stderr[-2000:]
        assert not loaded.exists(), "the pipeline was loaded before --out was checked"
        assert [name for name in partial if not (out / name).exists()] == [], "the refused run took the other's file"
        assert first.poll() is None, "the first run goes on"
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=EXIT_DEADLINE) == 130
    finally:
        end_popen(first)
    assert not out.exists()


def test_a_folder_whose_run_was_killed_is_free_for_the_next_run(tmp_path: Path) -> None:
    """The claim is the kernel's lock on the folder: it goes with the process, however it ends (kill -9 included)."""
    out = tmp_path / "out"
    first = _start_long_run(out)
    try:
        read_stderr_until(first, lambda text: b"10/100000 chunks" in text, "progress")
        first.kill()
        first.wait(timeout=EXIT_DEADLINE)
    finally:
        end_popen(first)
    result = _run(REPLAY, "--chunks", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["metrics.json", "video.mp4"]
