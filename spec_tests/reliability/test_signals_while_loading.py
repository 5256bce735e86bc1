"""Two stop signals while the pipeline still loads (Ctrl-C twice): the process ends now, with 128 + the first
signal, leaving no child process and no shared memory of its own or its children's in /dev/shm.

The pipeline (``gated_segments_world.py``) holds a tensor channel and does not return from its load until the test
opens its gate, which it never does here: only the second signal can end the process in time.

Before: the agent closed its signal receiver as it began to wait for the load, so the second signal met Python's
default action (killed by SIGTERM, -15; a KeyboardInterrupt traceback for SIGINT); stream-serve exited 143, but its
service child, still loading (the proxy not yet returned), died by its parent-death signal and left its segments.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ..cluster.conftest import TOKEN, Process, chunkline, clean_env, free_port
from .helpers import pid_alive, process_tree

PIPE = "spec_tests/reliability/gated_segments_world.py"
START_DEADLINE = 180.0  # wall seconds: a service child imports torch before it loads (a loaded host)
FIRST_DEADLINE = 30.0  # for the process to say it heard the first signal
EXIT_DEADLINE = 15.0  # from the second signal to the exit (the load would hold it 60 s)
GONE_DEADLINE = 5.0  # for its children, killed, to be gone

CASES = [
    pytest.param("worker", "in-process", signal.SIGINT, id="worker-in-process-SIGINT"),
    pytest.param("worker", "process", signal.SIGTERM, id="worker-process-SIGTERM"),
    pytest.param("stream-serve", "process", signal.SIGTERM, id="stream-serve-process-SIGTERM"),
]
#: what each command logs on the first signal while it loads
HEARD = {"worker": "before this agent served", "stream-serve": "shutting down"}


def segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("cl_")}


def owner(segment: str) -> int:
    return int(segment[len("cl_"):].split("-", 1)[0])


def until(done: object, what: str, deadline: float, process: Process) -> None:
    give_up = time.monotonic() + deadline
    while not done():  # type: ignore[operator]
        assert time.monotonic() < give_up, f"timed out after {deadline:g} s waiting for {what}:\n{process.text()}"
        time.sleep(0.05)  # bench-cost: real-time poll of another process, bounded by a deadline


@pytest.mark.parametrize(("command", "worker_mode", "signum"), CASES)
def test_a_second_stop_signal_while_the_pipeline_loads_ends_the_process_now_leaving_nothing(
        tmp_path: Path, command: str, worker_mode: str, signum: int) -> None:
    where = ["--authority", f"tcp://127.0.0.1:{free_port()}"] if command == "worker" else ["--port", "0"]
    before = segments()
    process = Process(chunkline(command, PIPE, *where, "--worker-mode", worker_mode),
                      clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN, GATED_WORLD=str(tmp_path)))
    try:
        until(lambda: (tmp_path / "loading").exists() or process.popen.poll() is not None, "the load",
              START_DEADLINE, process)
        assert process.popen.poll() is None, process.text()
        tree = process_tree(process.popen.pid)
        # the process's or its service child's (not those of other tests' processes made meanwhile)
        ours = {owner(name) for name in segments() - before} & tree
        assert ours, f"the load holds a tensor channel in /dev/shm:\n{process.text()}"
        process.popen.send_signal(signum)
        until(lambda: HEARD[command] in process.text(200_000), "the first signal's line", FIRST_DEADLINE, process)
        process.popen.send_signal(signum)
        try:
            code = process.popen.wait(EXIT_DEADLINE)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {EXIT_DEADLINE:g} s after the second signal:\n{process.text()}")
        process.stop()  # its log read to its end
        log = process.text(200_000)
        assert code == 128 + signum, log
        assert "exiting now" in log and "Traceback" not in log, log
        children = tree - {process.popen.pid}
        until(lambda: not any(pid_alive(pid) for pid in children), "its children to be gone", GONE_DEADLINE, process)
        left = sorted(name for name in segments() - before if owner(name) in tree)
        assert not left, f"{len(left)} segments left: {left[:5]}\n{log}"
    finally:
        (tmp_path / "open").touch()
        process.stop()
