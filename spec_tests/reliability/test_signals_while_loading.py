"""One stop signal while the pipeline still loads ends the process now, with 128 + the signal, leaving no child
process and no shared memory of its own or its children's in /dev/shm: before its service is up nothing can be
running on it, so there is nothing to drain, and a load (minutes, or hung) cannot be cancelled, only abandoned.

The pipeline (``gated_segments_world.py``) holds a tensor channel and does not return from its load until the test
opens its gate, which it never does here (it would give up on its own after 60 s).

Before: ``chunkline worker`` waited for the load to return, with no bound of its own; ``chunkline stream-serve`` waited
for its 55 s shutdown watchdog and exited 1, as a failure. Before that (two signals): the agent closed its signal
receiver as it began to wait for the load, so the second signal met Python's default action, and stream-serve's
service child, still loading, died by its parent-death signal and left its segments.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..cluster.conftest import ROOT, TOKEN, Process, chunkline, clean_env
from .helpers import channel_segments, pid_alive, process_tree, segment_owner

PIPE = "spec_tests/reliability/gated_segments_world.py"
START_DEADLINE = 180.0  # wall seconds: a service child imports torch before it loads (a loaded host)
EXIT_DEADLINE = 15.0  # from the signal to the exit (the load would hold it 60 s, the old watchdog 55 s)
GONE_DEADLINE = 5.0  # for its children, killed, to be gone

CASES = [  # (command, worker mode, signal, signals sent, port): each case its own port in 18900-18999
    pytest.param("stream-serve", "in-process", signal.SIGTERM, 1, 18931, id="stream-serve-in-process-SIGTERM"),
    pytest.param("stream-serve", "in-process", signal.SIGINT, 1, 18932, id="stream-serve-in-process-SIGINT"),
    pytest.param("stream-serve", "process", signal.SIGTERM, 1, 18933, id="stream-serve-process-SIGTERM"),
    pytest.param("stream-serve", "process", signal.SIGINT, 2, 18934, id="stream-serve-process-SIGINT-twice"),
    pytest.param("worker", "in-process", signal.SIGINT, 1, 18935, id="worker-in-process-SIGINT"),
    pytest.param("worker", "process", signal.SIGTERM, 1, 18936, id="worker-process-SIGTERM"),
    pytest.param("worker", "process", signal.SIGINT, 2, 18937, id="worker-process-SIGINT-twice"),
]


def until(done: object, what: str, deadline: float, process: Process) -> None:
    give_up = time.monotonic() + deadline
    while not done():  # type: ignore[operator]
        assert time.monotonic() < give_up, f"timed out after {deadline:g} s waiting for {what}:\n{process.text()}"
        time.sleep(0.05)  # bench-cost: real-time poll of another process, bounded by a deadline


def loading_tree(process: Process, gate: Path, before: set[str]) -> set[int]:
    """Wait until the pipeline loads, holding a tensor channel of the process's tree in /dev/shm; the tree's pids."""
    until(lambda: (gate / "loading").exists() or process.popen.poll() is not None, "the load", START_DEADLINE, process)
    assert process.popen.poll() is None, process.text()
    tree = process_tree(process.popen.pid)
    # the process's or its service child's (not those of other tests' processes made meanwhile)
    ours = {segment_owner(name) for name in channel_segments() - before} & tree
    assert ours, f"the load holds a tensor channel in /dev/shm:\n{process.text()}"
    return tree


def ended(process: Process) -> tuple[int, str]:
    """The exit status once the process ends (within EXIT_DEADLINE of the signal), and its whole log."""
    try:
        code = process.popen.wait(EXIT_DEADLINE)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {EXIT_DEADLINE:g} s after the signal:\n{process.text()}")
    process.stop()  # its log read to its end
    return code, process.text(200_000)


def nothing_left(process: Process, tree: set[int], before: set[str], log: str) -> None:
    """No process of the tree alive, no /dev/shm segment of it left."""
    children = tree - {process.popen.pid}
    until(lambda: not any(pid_alive(pid) for pid in children), "its children to be gone", GONE_DEADLINE, process)
    left = sorted(name for name in channel_segments() - before if segment_owner(name) in tree)
    assert not left, f"{len(left)} segments left: {left[:5]}\n{log}"


@pytest.mark.parametrize(("command", "worker_mode", "signum", "times", "port"), CASES)
def test_a_stop_signal_while_the_pipeline_loads_ends_the_process_now_leaving_nothing(
        tmp_path: Path, command: str, worker_mode: str, signum: int, times: int, port: int) -> None:
    where = ["--authority", f"tcp://127.0.0.1:{port}"] if command == "worker" else ["--port", str(port)]
    before = channel_segments()
    process = Process(chunkline(command, PIPE, *where, "--worker-mode", worker_mode),
                      clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN, GATED_WORLD=str(tmp_path)))
    try:
        tree = loading_tree(process, tmp_path, before)
        for _ in range(times):  # Ctrl-C twice at once: the same end
            process.popen.send_signal(signum)
        code, log = ended(process)
        assert code == 128 + signum, log
        assert "exiting now" in log and "Traceback" not in log, log
        nothing_left(process, tree, before, log)
    finally:
        (tmp_path / "open").touch()
        process.stop()


HYPERCORN_CASES = [  # (hypercorn's options, worker mode, signal, exit status or None, port in 18100-18199)
    # the supervisor drops its worker's exit status (README, Known limits): the worker's end is read in its log (0:
    # the supervisor's word may be a reload, after which it starts a new worker only if this one exited 0)
    pytest.param([], "in-process", signal.SIGTERM, None, 18141, id="supervised-asyncio-in-process"),
    pytest.param(["--worker-class", "trio"], "process", signal.SIGTERM, None, 18156, id="supervised-trio-process"),
    pytest.param(["--worker-class", "trio"], "in-process", signal.SIGTERM, None, 18142,
                 id="supervised-trio-in-process"),
    pytest.param(["--workers", "0"], "in-process", signal.SIGTERM, 143, 18143, id="one-process-asyncio-in-process"),
    pytest.param(["--workers", "0", "--worker-class", "trio"], "process", signal.SIGTERM, 143, 18144,
                 id="one-process-trio-process"),
    pytest.param(["--workers", "0", "--worker-class", "trio"], "in-process", signal.SIGINT, 130, 18145,
                 id="one-process-trio-in-process-SIGINT"),
]


@pytest.mark.parametrize(("options", "worker_mode", "signum", "status", "port"), HYPERCORN_CASES)
def test_a_stop_signal_while_the_pipeline_loads_ends_hypercorn_now_leaving_nothing(
        tmp_path: Path, options: list[str], worker_mode: str, signum: int, status: int | None, port: int) -> None:
    """Under ``hypercorn server:app`` as under stream-serve: after the (empty) drain the worker ends at once, its
    load abandoned with its children and their segments (exit 128 + the signal, or 0 on hypercorn's supervisor's
    word). Before, the app's shutdown waited for the load to return (the gate's 60 s here), and the exit was 0."""
    before = channel_segments()
    command = [sys.executable, "-m", "hypercorn", *options, "--bind", f"127.0.0.1:{port}", "server:app"]
    process = Process(command, clean_env(CHUNKLINE_PIPELINE=PIPE, CHUNKLINE_WORKER_MODE=worker_mode,
                                         GATED_WORLD=str(tmp_path)))
    try:
        tree = loading_tree(process, tmp_path, before)
        process.popen.send_signal(signum)  # to hypercorn's supervisor (or its one process), as a service manager does
        code, log = ended(process)
        assert status is None or code == status, log
        worker_status = 128 + signum if status is not None else 0
        assert f"exiting now (exit {worker_status})" in log and "Traceback" not in log, log
        nothing_left(process, tree, before, log)
    finally:
        (tmp_path / "open").touch()
        process.stop()


WATCHDOG = """
import sys, threading
from server.stop_guard import BoundWatch
removed = []
BoundWatch(0.05, lambda: removed.append(1), [int(n) for n in sys.argv[1:]]).arm()
threading.Event().wait(30)  # bench-cost: stands for a shutdown that hangs past its bound; the watchdog ends it
"""


@pytest.mark.parametrize(("signalled", "expected"), [([signal.SIGTERM], 143), ([signal.SIGINT], 130), ([], 1)],
                         ids=["SIGTERM", "SIGINT", "no signal"])
def test_the_shutdown_watchdog_exits_with_the_signal_that_began_the_shutdown(signalled: list[int],
                                                                             expected: int) -> None:
    """The drain cut short by its bound is a stop that was asked for (128 + the signal, as a second signal's abort
    and an agent's rule say), not a failure; 1 only when no signal began it."""
    done = subprocess.run([sys.executable, "-c", WATCHDOG, *map(str, signalled)], cwd=str(ROOT),
                          env=clean_env(), capture_output=True, timeout=60)
    assert done.returncode == expected, done.stderr.decode(errors="replace")
    assert b"shutdown exceeded its bound" in done.stderr, done.stderr
