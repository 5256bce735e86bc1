"""``chunkline run`` as a user meets it: stopped by a real signal mid-run it leaves no partial file and its exit
code says so; an option the pipeline does not know is bad input (exit 2), not silently ignored."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pipelines

REPLAY = str(Path(pipelines.__file__).parent / "replay")
PROGRESS_DEADLINE = 60.0  # seconds for the child to import its pipeline and write its first chunk
EXIT_DEADLINE = 30.0


def _start_long_run(out: Path) -> subprocess.Popen[bytes]:
    """A replay run far longer than the test: it is stopped by the signal, never by its end."""
    command = [sys.executable, "-m", "server.cli", "run", REPLAY, "--chunks", "100000",
               "--option", "duration_seconds=86400", "--out", str(out)]

    def default_signals() -> None:  # a child of a non-interactive shell may inherit SIGINT ignored
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, signal.SIG_DFL)

    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_signals)


def _chunks_done(progress: bytes) -> int:
    counts = re.findall(rb"(\d+)/\d+ chunks", progress)
    return int(counts[-1]) if counts else 0


def _wait_for_progress(process: subprocess.Popen[bytes]) -> bytes:
    """Read the child's stderr until its progress bar shows more chunks done than its writer's queue holds
    (4), so the writer has opened its temporary file."""
    assert process.stderr is not None
    seen = b""
    deadline = time.monotonic() + PROGRESS_DEADLINE
    with selectors.DefaultSelector() as selector:
        selector.register(process.stderr, selectors.EVENT_READ)
        while _chunks_done(seen) < 10:
            left = deadline - time.monotonic()
            assert left > 0, f"no progress within {PROGRESS_DEADLINE} s: {seen[-500:]!r}"
            if selector.select(left):
                data = os.read(process.stderr.fileno(), 65536)
                assert data, f"the run ended before any progress: {seen[-500:]!r}"
                seen += data
    return seen


@pytest.mark.parametrize(("signal_number", "code", "message"), [
    (signal.SIGTERM, 143, b"terminated (SIGTERM); no output was written"),
    (signal.SIGINT, 130, b"interrupted; no output was written"),
])
def test_a_signal_mid_run_leaves_no_partial_file(tmp_path: Path, signal_number: int, code: int, message: bytes) -> None:
    out = tmp_path / "out"
    process = _start_long_run(out)
    try:
        _wait_for_progress(process)
        assert [p.name for p in out.iterdir() if p.name.endswith(".partial")], "the run writes to a temporary file"
        process.send_signal(signal_number)
        _, err = process.communicate(timeout=EXIT_DEADLINE)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == code, err[-2000:]
    assert message in err
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_an_option_the_toy_world_does_not_know_exits_2_naming_it(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from server.cli import main

    out = tmp_path / "out"
    toy_world = str(Path(pipelines.__file__).parent / "toy_world")
    assert main(["run", toy_world, "--chunks", "1", "--option", "seeed=3", "--out", str(out)]) == 2
    assert "unknown option(s) ['seeed']" in capsys.readouterr().err
    assert not out.exists()
