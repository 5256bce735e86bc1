"""hypercorn's reload, and stop signals, before its worker serves: a reload is a reload in every phase of the worker's
life, and a stop signal to a worker that has not begun to serve ends it in one line, nothing left.

A reload (SIGHUP to hypercorn's supervisor, or to its whole process group as a closed terminal sends it) while the
worker still loads its pipeline ends that worker at once after its empty drain, its load abandoned with its /dev/shm
segments, with exit 0: hypercorn's supervisor starts a new worker only after a 0 (any other status it takes for a
reason to stop), and it cannot tell the worker whether it stops or reloads. Before: the worker ended with 129 (143 when
only the supervisor got SIGHUP) and the supervisor stopped.

While hypercorn's worker imports and builds the app (``spec_tests/server/slow_start_app.py`` holds it there), a
stop signal unwinds the start (no traceback): SIGHUP under the supervisor (its reload) with exit 0, and a new worker
serves; any other with 128 + the signal (under the supervisor a nonzero status stops it, as a stop signal to the worker
alone does while it serves). One that comes once the app is built is held until the worker's loop begins, and ends it
there the same way, before anything started. Before: Python's default action: the worker killed by SIGHUP or SIGTERM
(the supervisor then stopped, after a reload too), a KeyboardInterrupt traceback under ``--workers 0``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from ..processes import end_process
from ..reliability.helpers import channel_segments, kill_what_is_left, pid_alive, process_tree, processes_left, \
    segment_owner
from .test_hypercorn import semaphores_left_behind
from .test_hypercorn_stop_signals import GONE_DEADLINE, START_DEADLINE, TRACKER_FORGOT, TRACKER_RELAUNCHED, Hypercorn, \
    start

GATED = "spec_tests/reliability/gated_segments_world.py"  # holds a tensor channel and its load until $GATED_WORLD/open
SLOW_START = "spec_tests.server.slow_start_app:app"  # holds the app's start until $SLOW_START/go
EXIT_DEADLINE = 15.0  # from the signal to the worker's end (the held load or start would hold it 30 to 60 s)


async def until(done: Callable[[], Any], what: str, hypercorn: Hypercorn, deadline: float = START_DEADLINE) -> None:
    """Wait until ``done()`` while hypercorn runs."""
    with trio.fail_after(deadline):
        while not done():
            assert hypercorn.process.returncode is None, f"hypercorn ended waiting for {what}:\n{hypercorn.text()}"
            await trio.sleep(0.02)  # bench-cost: real-time poll of hypercorn's processes, bounded by a deadline


async def nothing_left(hypercorn: Hypercorn, tree: set[int], before: set[str]) -> None:
    """hypercorn ended, every process of ``tree`` gone, nothing of theirs in /dev/shm."""
    assert await processes_left(tree, GONE_DEADLINE) == [], hypercorn.text()
    assert sorted(n for n in channel_segments() - before if segment_owner(n) in tree) == [], hypercorn.text()
    assert await semaphores_left_behind(before) == []  # the supervisor's shutdown event's


def without_tracker_noise(log: bytearray) -> bytes:
    """hypercorn's log without what its supervisor's resource tracker says after a SIGHUP to the process group killed
    it (README, Known limits): not chunkline's."""
    return TRACKER_RELAUNCHED.sub(b"", TRACKER_FORGOT.sub(b"", bytes(log)))


RELOAD_WHILE_LOADING = [  # (hypercorn's options, who gets SIGHUP)
    pytest.param(["--worker-class", "trio"], "group", id="trio-group"),
    pytest.param([], "supervisor", id="asyncio-supervisor"),
]


@pytest.mark.parametrize(("options", "whom"), RELOAD_WHILE_LOADING)
async def test_a_reload_while_the_worker_loads_its_pipeline_starts_a_new_worker(
        tmp_path: Path, options: list[str], whom: str) -> None:
    before = channel_segments() | {n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")}
    hypercorn = await start(options, CHUNKLINE_PIPELINE=GATED, CHUNKLINE_WORKER_MODE="in-process",
                            GATED_WORLD=str(tmp_path))
    loading, tree = tmp_path / "loading", set[int]()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hypercorn.read_log)
            await until(loading.exists, "the first worker's load", hypercorn)
            first, tree = hypercorn.worker(), process_tree(hypercorn.process.pid)
            held = {n for n in channel_segments() - before if segment_owner(n) == first}
            assert held, f"the load holds a tensor channel in /dev/shm:\n{hypercorn.text()}"
            loading.unlink()
            if whom == "group":
                os.killpg(hypercorn.process.pid, signal.SIGHUP)
            else:
                hypercorn.process.send_signal(signal.SIGHUP)
            await until(lambda: not pid_alive(first), "the first worker's end", hypercorn, EXIT_DEADLINE)
            assert held.isdisjoint(channel_segments()), hypercorn.text()  # its load abandoned with its channel
            await until(loading.exists, "a new worker's load", hypercorn)
            (tmp_path / "open").touch()
            await hypercorn.serving(workers=2)
            tree |= process_tree(hypercorn.process.pid)
            hypercorn.process.send_signal(signal.SIGTERM)
            assert await hypercorn.ended() == 0, hypercorn.text()
            nursery.cancel_scope.cancel()
        await nothing_left(hypercorn, tree, before)
    finally:
        (tmp_path / "open").touch()
        await end_process(hypercorn.process)
        kill_what_is_left(tree)
    log = without_tracker_noise(hypercorn.log) if whom == "group" else bytes(hypercorn.log)
    assert b"still loads its pipeline" in log and b"exiting now (exit 0)" in log, hypercorn.text()
    assert b"Traceback" not in log and b"Warning" not in log, hypercorn.text()


START_CASES = [  # (hypercorn's options, whom, the signal, after the app is built?, hypercorn's exit status, reloads?)
    pytest.param(["--worker-class", "trio"], "group", signal.SIGHUP, False, 0, True, id="trio-group-SIGHUP"),
    pytest.param([], "worker", signal.SIGHUP, True, 0, True, id="asyncio-worker-SIGHUP-built"),
    # the supervisor drops its worker's status (README, Known limits): the worker's is read in its one line
    pytest.param([], "worker", signal.SIGTERM, False, 0, False, id="asyncio-worker-SIGTERM"),
    pytest.param(["--workers", "0", "--worker-class", "trio"], "worker", signal.SIGTERM, False, 143, False,
                 id="one-process-trio-SIGTERM"),
    pytest.param(["--workers", "0"], "group", signal.SIGINT, True, 130, False, id="one-process-asyncio-Ctrl-C-built"),
]


@pytest.mark.parametrize(("options", "whom", "signum", "built", "status", "reloads"), START_CASES)
async def test_a_stop_signal_before_hypercorns_worker_serves_ends_its_start_in_one_line(
        tmp_path: Path, options: list[str], whom: str, signum: int, built: bool, status: int, reloads: bool) -> None:
    if built:
        (tmp_path / "build").touch()
    before = {n for n in os.listdir("/dev/shm") if n.startswith(("cl_", "sem.mp-"))}
    hypercorn = await start(options, target=SLOW_START, CHUNKLINE_PIPELINE="pipelines/toy_world",
                            CHUNKLINE_WORKER_MODE="in-process", SLOW_START=str(tmp_path))
    starting, tree = tmp_path / "starting", set[int]()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hypercorn.read_log)
            await until(starting.exists, "the worker's start", hypercorn)
            first = int(starting.read_text())
            starting.unlink()
            tree = process_tree(hypercorn.process.pid)
            if whom == "group":
                os.killpg(hypercorn.process.pid, signum)
            else:
                os.kill(first, signum)
            (tmp_path / "go").touch()  # a signal noted once the app was built ends the start as its loop begins
            await until(lambda: not pid_alive(first), "the worker's end", hypercorn, EXIT_DEADLINE)
            if reloads:
                await until(starting.exists, "a new worker's start", hypercorn)
                await hypercorn.serving()
                tree |= process_tree(hypercorn.process.pid)
                hypercorn.process.send_signal(signal.SIGTERM)
            assert await hypercorn.ended() == status, hypercorn.text()
            nursery.cancel_scope.cancel()
        await nothing_left(hypercorn, tree, before)
    finally:
        (tmp_path / "go").touch()
        await end_process(hypercorn.process)
        kill_what_is_left(tree)
    then = "hypercorn's reload starts a new worker" if reloads else f"exit {128 + signum}"
    assert f"as hypercorn's worker started: {then}".encode() in hypercorn.log, hypercorn.text()
    assert hypercorn.log.count(b"as hypercorn's worker started") == 1, hypercorn.text()
    assert b"Traceback" not in without_tracker_noise(hypercorn.log), hypercorn.text()
