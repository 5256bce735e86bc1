"""``chunkline run pipelines/replay --option video_path=...`` naming a folder or a pipe says what it is, exit 2.

Both were refused as ``no such file``, of a path that plainly exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to load the replay pipeline and refuse its option


@pytest.mark.parametrize(("kind", "said"), [("folder", "is a directory, not a file"),
                                            ("pipe", "is not a regular file (a pipe, a socket or a device)")])
def test_a_video_path_that_is_no_file_is_refused_saying_what_it_is(tmp_path: Path, kind: str, said: str) -> None:
    video = tmp_path / "clip.mp4"
    if kind == "folder":
        video.mkdir()
    else:
        os.mkfifo(video)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(ROOT / "pipelines" / "replay"), "--chunks", "1",
                           "--option", f"video_path={video}", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL)
    assert done.stderr.splitlines() == [f"chunkline run: --option: replay option 'video_path': {str(video)!r} {said}"], done.stderr
    assert done.returncode == 2
    assert not out.exists()
