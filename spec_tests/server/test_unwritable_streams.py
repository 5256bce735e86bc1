"""A command whose stdout or stderr cannot be written still does its work: the lines are lost, nothing else.

``chunkline stream-serve`` whose stderr went to a full disk (``2>/dev/full``, a log redirected to a full volume)
exited 1 before it served: its "serving" line raised. ``chunkline run`` with stderr closed (``2>&-``) failed before
the run began (``AttributeError: 'NoneType' object has no attribute 'isatty'``, said on stdout), and one whose stdout
could not take its summary (closed, or a full disk) exited 1 saying ``the run failed: ...`` with its complete
output left in place. Through real processes (``server.console.tell``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from ..processes import end_process
from ..reliability.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 120.0  # wall seconds: a loaded 2-core host imports the server stack and loads the replay
RUN = [sys.executable, "-m", "server.cli", "run", "pipelines/replay", "--chunks", "2"]


def run_with(redirect: str, out: Path) -> subprocess.CompletedProcess[str]:
    """``chunkline run`` under a shell's ``redirect`` of its own streams (``>&-``, ``2>&-``, ``>/dev/full``)."""
    return subprocess.run(["sh", "-c", f'exec "$@" {redirect}', "sh", *RUN, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE)


@pytest.mark.parametrize(("redirect", "why"), [(">&-", "the stream is closed"),
                                               (">/dev/full", "No space left on device")],
                         ids=["stdout_closed", "stdout_full"])
def test_a_run_whose_summary_cannot_be_written_keeps_its_output_and_exits_0(
    redirect: str, why: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    done = run_with(redirect, out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"chunkline run: warning: the summary could not be written to stdout ({why}); the output is in {out}")
    assert "failed" not in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "video.mp4"]


def test_a_run_with_stderr_closed_runs_and_says_nothing_on_stdout_but_its_summary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_with("2>&-", out)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "chunkline run:" not in done.stdout and done.stdout.splitlines()[0].startswith("pipeline "), done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "video.mp4"]


async def test_stream_serve_serves_with_a_stderr_it_cannot_write(short_tmp: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    env.update(TMPDIR=str(short_tmp))
    with open("/dev/full", "wb") as full:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "server.cli", "stream-serve", "pipelines/replay", "--port", str(port)],
            cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=full)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            with trio.fail_after(DEADLINE):
                while True:
                    assert process.poll() is None, f"the server exited {process.returncode} before it served"
                    try:
                        if (await client.get("/v1/service/ready")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.1)  # bench-cost: the subprocess imports the server and loads its pipeline
            created = await client.post("/v1/stream/sessions", json={"identity": "ctl"})
            assert created.status_code == 200, created.text
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(DEADLINE):
            assert await process.wait() == 0
    finally:
        await end_process(process)
