"""``chunkline run --out DIR`` where DIR is a folder no file can be made in (a read-only file system, or a folder
the user may not write): refused before the pipeline loads, exit 2, one line naming ``--out`` and why. It passed
the flag checks, ran the whole pipeline, and then failed at its video (exit 1, ``PermissionError``), the
generation lost. Through a real process; the folder is made read-only in a mount namespace of the command's own
(root writes any folder it owns)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ..namespaces import READ_ONLY_FOLDER, unshare_or_skip

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 120.0  # wall seconds: a loaded 2-core host imports the pipeline stack


def test_a_run_into_a_folder_no_file_can_be_made_in_is_refused_before_it_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    argv = unshare_or_skip("-rm", READ_ONLY_FOLDER, str(out), sys.executable, "-m", "server.cli", "run",
                           "pipelines/replay", "--chunks", "2", "--out", str(out))
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", f"chunkline run: --out {str(out)!r}: no file can be written in it: Read-only file system\n")
    assert list(out.iterdir()) == []
