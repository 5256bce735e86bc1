"""The temporary files of a ``chunkline run`` killed outright (SIGKILL, a host out of memory) stayed in its ``--out``
for good: a later run into the same folder removed only its own. A run now removes those of runs whose process is
gone, and says so; those of a run still going (its process is there) are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import the replay pipeline and write two chunks


def test_a_run_removes_the_temporary_files_of_runs_killed_before_they_finished(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    gone = _pid_of_an_ended_process()
    stale = [out / f".video.mp4.{gone}.0badf00d.partial", out / f".metrics.json.{gone}.0badf00d.partial"]
    for path in stale:
        path.write_bytes(b"half a file")
    live = out / f".video.mp4.{os.getpid()}.0badf00d.partial"  # this process runs: as if a run were writing it
    live.write_bytes(b"being written")
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", "pipelines/replay", "--chunks", "2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(os.listdir(out)) == sorted(["metrics.json", "video.mp4", live.name])
    assert (f"removed 2 temporary file(s) that runs killed before they finished left in {out}") in done.stderr


def _pid_of_an_ended_process() -> int:
    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: its pid names no process (until the kernel hands it out again, far later)
    return ended.pid
