"""Stop signals to every process of ``hypercorn server:app``, as a service manager or a terminal sends them.

A stop signal to hypercorn's whole process group (systemd's default ``KillMode=control-group``, ``kill -TERM
-PGID``, Ctrl-C in a terminal) reaches its worker process too, and one to the worker alone stops the server as one to
the supervisor does: the sessions drain (their room clients get ``done``), hypercorn exits 0 and nothing is left
running or in /dev/shm. A second stop signal while the drain is under way ends it now, as under ``chunkline
stream-serve``: exit 128 + the first signal (hypercorn's supervisor drops its worker's status and exits 0), one line,
no traceback, nothing left.

SIGHUP is hypercorn's word for a reload: under its supervisor the worker that gets it (from the process group, as a
closed terminal sends it, or alone) drains its sessions, and a new worker serves; under ``hypercorn --workers 0`` (no
supervisor, no reload) it stops the server as SIGTERM does, unless it was ignored as hypercorn started (``nohup``).

Before: a group SIGTERM ended the worker by the signal's default action (no drain, no ``done``; README said to use
``KillMode=mixed``), and so did one to the worker alone; a second signal under ``hypercorn --workers 0`` met Python's
default action (death by SIGTERM, or a KeyboardInterrupt traceback after Ctrl-C), and a second Ctrl-C under the
supervisor did nothing (its worker ignored SIGINT). SIGHUP ended the worker, or ``--workers 0``'s one process, by
its default action: no drain, no ``done``, and the supervisor stopped rather than reload (its worker was killed).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from server.transport.client import RoomClient

from ..pipelines.hung_stage_world import HANG_FROM
from ..processes import end_process
from ..reliability.helpers import kill_what_is_left, pid_alive, process_tree, processes_left, segment_owner
from .test_hypercorn import APP_TARGET, ROOT, RUNNING, SESSIONS, semaphores_left_behind, server_env, status_of
from .test_hypercorn_process_mode import parent_of

START_DEADLINE = 120.0  # wall seconds: hypercorn spawns its worker, which imports torch and loads the toy world
EXIT_DEADLINE = 30.0  # from the signal to hypercorn's exit (a drain of one session: a chunk or two)
GONE_DEADLINE = 5.0  # for every process of the tree to be gone once hypercorn has exited
HUNG = "spec_tests/pipelines/hung_stage_world.py"  # its model stage hangs from chunk HANG_FROM on: a drain never ends


def segments() -> set[str]:
    """The channels' segments and multiprocessing's semaphores in /dev/shm."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(("cl_", "sem.mp-"))}


def command_line(pid: int) -> bytes:
    """A process's command line; empty once it ended."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


class Hypercorn:
    """``hypercorn server:app`` in a process group of its own (``start_new_session``), its log kept."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.log = bytearray()
        self.url = ""

    def text(self) -> str:
        return self.log.decode(errors="replace")[-4000:]

    async def read_log(self) -> None:
        assert self.process.stderr is not None
        async for data in self.process.stderr:
            self.log.extend(data)

    async def serving(self, workers: int = 1) -> None:
        """Once the ``workers``-th worker process hypercorn started serves, its pipeline loaded."""
        with trio.fail_after(START_DEADLINE):
            while len(RUNNING.findall(self.log)) < workers:
                assert self.process.returncode is None, self.text()
                await trio.sleep(0.05)  # bench-cost: hypercorn spawns its worker, which imports the app
            self.url = RUNNING.search(self.log).group(1).decode()  # type: ignore[union-attr]
            async with httpx.AsyncClient(base_url=self.url, timeout=10) as client:
                while (response := await client.get("/v1/service/ready")).status_code != 200:
                    assert response.status_code == 503, response.text
                    await trio.sleep(0.1)  # bench-cost: the worker loads its pipeline

    async def streaming_controller(self, chunks: int = 1) -> tuple[RoomClient, str, list[Any]]:
        """A session's controller in its room once ``chunks`` chunks came; the session's id and what the room said."""
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as client:
            response = await client.post(SESSIONS, json={"identity": "ctl"})
            assert response.status_code == 200, response.text
            live = response.json()
        port = int(self.url.rsplit(":", 1)[1])
        controller = await RoomClient.connect("127.0.0.1", port, f"{live['websocket_path']}?token={live['token']}")
        heard: list[Any] = []
        with trio.fail_after(START_DEADLINE):
            while sum(status_of(m) == "chunk" for m in heard) < chunks:
                heard.append(await controller.receive())
        return controller, live["session_id"], heard

    def workers(self) -> list[int]:
        """hypercorn's worker processes: the children its supervisor spawned (not the supervisor's resource tracker)."""
        children = [pid for pid in process_tree(self.process.pid) if parent_of(pid) == self.process.pid]
        return [pid for pid in children if b"spawn_main" in command_line(pid)]

    def worker(self) -> int:
        """hypercorn's one worker process."""
        workers = self.workers()
        assert len(workers) == 1, workers
        return workers[0]

    async def ended(self) -> int:
        with trio.move_on_after(EXIT_DEADLINE):
            await self.process.wait()
        assert self.process.returncode is not None, f"still running {EXIT_DEADLINE:g} s after a signal:\n{self.text()}"
        return self.process.returncode


async def start(options: list[str], prefix: tuple[str, ...] = (), target: str = APP_TARGET, **env: str) -> Hypercorn:
    """hypercorn started with ``options``, through ``prefix`` (``nohup``) if any, serving ``target``."""
    command = [*prefix, sys.executable, "-m", "hypercorn", *options, "--bind", "127.0.0.1:0", target]
    process = await trio.lowlevel.open_process(command, cwd=str(ROOT), env=server_env() | env,
                                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.PIPE, start_new_session=True)
    return Hypercorn(process)


async def heard_to_the_end(controller: RoomClient, heard: list[Any]) -> list[Any]:
    """What the room said until it closed (or EXIT_DEADLINE passed); the ``done`` messages' payloads."""
    with trio.move_on_after(EXIT_DEADLINE):
        while (message := await controller.receive()) is not None:
            heard.append(message)
    await controller.aclose()
    return [m["payload"] for m in heard if status_of(m) == "done"]


@attrs.define
class Streaming:
    """hypercorn serving, a session's controller in its room (what the room said so far), the process tree it had
    then (``tree``; a test that starts more processes adds them) and /dev/shm before it started."""

    hypercorn: Hypercorn
    controller: RoomClient
    session_id: str
    heard: list[Any]
    tree: set[int]
    before: set[str]

    async def nothing_left(self) -> None:
        """Every process of the tree gone, and nothing of theirs in /dev/shm."""
        left = await processes_left(self.tree, GONE_DEADLINE)
        assert left == [], f"still running: {left}\n{self.hypercorn.text()}"
        ours = sorted(name for name in segments() - self.before
                      if name.startswith("cl_") and segment_owner(name) in self.tree)
        assert ours == [], ours
        assert await semaphores_left_behind(self.before) == []  # the supervisor's shutdown event's


@contextlib.asynccontextmanager
async def streaming(options: list[str], prefix: tuple[str, ...] = (), chunks: int = 1,
                    **env: str) -> AsyncIterator[Streaming]:
    """hypercorn started (:func:`start`), serving, and a session streaming until ``chunks`` chunks came; on the way
    out hypercorn and every process of the tree are ended, whatever happened."""
    before = segments()
    hypercorn = await start(options, prefix, **env)
    tree: set[int] = set()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hypercorn.read_log)
            await hypercorn.serving()
            controller, session_id, heard = await hypercorn.streaming_controller(chunks)
            tree = process_tree(hypercorn.process.pid)
            yield Streaming(hypercorn, controller, session_id, heard, tree, before)
            nursery.cancel_scope.cancel()
    finally:
        await end_process(hypercorn.process)
        kill_what_is_left(tree)


GROUP_CASES = [  # (hypercorn's options, worker mode, who gets the signal, the signal)
    pytest.param(["--worker-class", "trio"], "in-process", "group", signal.SIGTERM, id="trio-group-SIGTERM"),
    pytest.param([], "in-process", "group", signal.SIGTERM, id="asyncio-group-SIGTERM"),
    pytest.param(["--worker-class", "trio"], "process", "group", signal.SIGTERM, id="trio-process-group-SIGTERM"),
    pytest.param(["--worker-class", "trio"], "in-process", "group", signal.SIGINT, id="trio-group-SIGINT"),
    pytest.param([], "in-process", "worker", signal.SIGTERM, id="asyncio-worker-SIGTERM"),
]


@pytest.mark.parametrize(("options", "worker_mode", "whom", "signum"), GROUP_CASES)
async def test_a_stop_signal_to_hypercorns_process_group_or_its_worker_drains_as_one_to_the_supervisor(
        options: list[str], worker_mode: str, whom: str, signum: int) -> None:
    async with streaming(options, CHUNKLINE_PIPELINE="pipelines/toy_world", CHUNKLINE_WORKER_MODE=worker_mode) as run:
        hypercorn, heard = run.hypercorn, run.heard
        if whom == "group":
            os.killpg(hypercorn.process.pid, signum)
        else:  # the worker alone: the server stops as a whole (hypercorn would start a new worker after a 0)
            os.kill(hypercorn.worker(), signum)
        done = await heard_to_the_end(run.controller, heard)
        assert await hypercorn.ended() == 0, hypercorn.text()
        assert len(done) == 1 and done[0]["reason"] == "shutdown", (heard[-3:], hypercorn.text())
        await run.nothing_left()
    assert b"Traceback" not in hypercorn.log and b"exiting now" not in hypercorn.log, hypercorn.text()


SECOND_CASES = [  # (hypercorn's options, worker mode, the signal (sent twice), to the group?, hypercorn's exit status)
    pytest.param(["--workers", "0", "--worker-class", "trio"], "in-process", signal.SIGTERM, False, 143,
                 id="one-process-trio-SIGTERM"),
    pytest.param(["--workers", "0"], "process", signal.SIGINT, True, 130, id="one-process-asyncio-process-Ctrl-C"),
    pytest.param(["--workers", "0", "--worker-class", "trio"], "in-process", signal.SIGHUP, False, 129,
                 id="one-process-trio-SIGHUP"),
    # the supervisor drops its worker's status (README, Known limits): the worker's end is read in its log
    pytest.param(["--worker-class", "trio"], "in-process", signal.SIGTERM, True, 0, id="supervised-trio-group-SIGTERM"),
]


@pytest.mark.parametrize(("options", "worker_mode", "signum", "group", "status"), SECOND_CASES)
async def test_a_second_stop_signal_while_hypercorn_drains_ends_it_now_leaving_nothing(
        options: list[str], worker_mode: str, signum: int, group: bool, status: int) -> None:
    # the next chunk never comes: the drain waits for it
    async with streaming(options, chunks=HANG_FROM, CHUNKLINE_PIPELINE=HUNG, CHUNKLINE_WORKER_MODE=worker_mode) as run:
        hypercorn = run.hypercorn

        def send() -> None:
            if group:
                os.killpg(hypercorn.process.pid, signum)
            else:
                hypercorn.process.send_signal(signum)

        send()
        async with httpx.AsyncClient(base_url=hypercorn.url, timeout=10) as client:
            with trio.fail_after(EXIT_DEADLINE):  # the drain waits for a chunk that never comes
                while (await client.get(f"{SESSIONS}/{run.session_id}")).json()["status"] != "draining":
                    await trio.sleep(0.05)  # bench-cost: real-time poll of the server's drain
        send()
        assert await hypercorn.ended() == status, hypercorn.text()
        await run.controller.aclose()
        await run.nothing_left()
    assert f"exiting now (exit {128 + signum})".encode() in hypercorn.log, hypercorn.text()
    assert b"Traceback" not in hypercorn.log, hypercorn.text()


#: a SIGHUP to the process group kills multiprocessing's resource tracker in it (it ignores SIGINT and SIGTERM only):
#: hypercorn's supervisor starts another as it spawns the new worker, which does not know the shutdown event's
#: semaphores when the supervisor unlinks them as it exits
TRACKER_RELAUNCHED = re.compile(rb"[^\n]*resource_tracker\.py:\d+: UserWarning: resource_tracker: process died "
                                rb"unexpectedly, relaunching\.  Some resources might leak\.\n"
                                rb"  warnings\.warn\([^\n]*\n")
TRACKER_FORGOT = re.compile(rb"Traceback \(most recent call last\):\n  File \"[^\"]*resource_tracker\.py\", line \d+, "
                            rb"in main\n    cache\[rtype\]\.remove\(name\)\nKeyError: '/mp-[^']*'\n")
RELOAD_CASES = [  # (hypercorn's options, who gets the SIGHUP)
    pytest.param(["--worker-class", "trio"], "group", id="trio-group-SIGHUP"),
    pytest.param([], "worker", id="asyncio-worker-SIGHUP"),
]


@pytest.mark.parametrize(("options", "whom"), RELOAD_CASES)
async def test_sighup_under_hypercorns_supervisor_drains_its_worker_and_a_new_one_serves(
        options: list[str], whom: str) -> None:
    """hypercorn's supervisor takes SIGHUP for a reload: its worker drains (through the shutdown event), exits 0, and a
    new worker starts. A SIGHUP to the process group (a closed terminal) reaches the worker too, and one may reach the
    worker alone: either way the worker drains (its client gets ``done``) and a new worker serves, as the reload
    does; nothing is passed on to the supervisor, which then stops on SIGTERM as ever, leaving nothing behind."""
    async with streaming(options, CHUNKLINE_PIPELINE="pipelines/toy_world", CHUNKLINE_WORKER_MODE="in-process") as run:
        hypercorn, heard = run.hypercorn, run.heard
        first = hypercorn.worker()
        if whom == "group":
            os.killpg(hypercorn.process.pid, signal.SIGHUP)
        else:
            os.kill(first, signal.SIGHUP)
        done = await heard_to_the_end(run.controller, heard)
        assert len(done) == 1 and done[0]["reason"] == "shutdown", (heard[-3:], hypercorn.text())
        await hypercorn.serving(workers=2)  # the reload's new worker
        assert hypercorn.worker() != first and not pid_alive(first), hypercorn.text()
        again, _, _ = await hypercorn.streaming_controller()
        await again.aclose()
        run.tree |= process_tree(hypercorn.process.pid)
        hypercorn.process.send_signal(signal.SIGTERM)
        assert await hypercorn.ended() == 0, hypercorn.text()
        await run.nothing_left()
    assert b"hypercorn's reload" in hypercorn.log, hypercorn.text()
    log = bytes(hypercorn.log)
    if whom == "group":  # the supervisor's resource tracker (README, Known limits), not chunkline's
        log = TRACKER_RELAUNCHED.sub(b"", TRACKER_FORGOT.sub(b"", log))
    assert b"Traceback" not in log and b"exiting now" not in log and b"Warning" not in log, hypercorn.text()


ONE_PROCESS_CASES = [  # (hypercorn's options, worker mode, started under nohup?)
    pytest.param(["--worker-class", "trio"], "process", False, id="trio-process-SIGHUP"),
    pytest.param([], "in-process", True, id="asyncio-SIGHUP-under-nohup-then-SIGTERM"),
]


@pytest.mark.parametrize(("options", "worker_mode", "nohup"), ONE_PROCESS_CASES)
async def test_sighup_stops_hypercorn_workers_0_as_sigterm_does_unless_ignored_as_it_started(
        options: list[str], worker_mode: str, nohup: bool) -> None:
    """Under ``hypercorn --workers 0`` no supervisor reloads anything: SIGHUP (a closed terminal) is a stop signal, as
    under ``chunkline stream-serve``: the sessions drain (``done``), exit 0 as after SIGTERM's drain, nothing left.
    Ignored as hypercorn started (``nohup``), it stays ignored: the session streams on, and SIGTERM stops it."""
    async with streaming(["--workers", "0", *options], ("nohup",) if nohup else (),
                         CHUNKLINE_PIPELINE="pipelines/toy_world", CHUNKLINE_WORKER_MODE=worker_mode) as run:
        hypercorn, controller, heard = run.hypercorn, run.controller, run.heard
        hypercorn.process.send_signal(signal.SIGHUP)
        if nohup:  # two more chunks (a key held: the toy world streams on), no drain
            await controller.send_json({"topic": "tf.control", "payload": {"type": "control_state",
                                                                          "controls": ["w"]}})
            chunks = sum(status_of(m) == "chunk" for m in heard) + 2
            with trio.move_on_after(EXIT_DEADLINE):
                while sum(status_of(m) == "chunk" for m in heard) < chunks:
                    heard.append(message := await controller.receive())
                    assert message is not None and status_of(message) != "done", (heard[-3:], hypercorn.text())
            assert sum(status_of(m) == "chunk" for m in heard) == chunks, ([status_of(m) for m in heard],
                                                                             hypercorn.text())
            hypercorn.process.send_signal(signal.SIGTERM)
        done = await heard_to_the_end(controller, heard)
        assert await hypercorn.ended() == 0, hypercorn.text()
        assert len(done) == 1 and done[0]["reason"] == "shutdown", (heard[-3:], hypercorn.text())
        await run.nothing_left()
    assert (b"(SIGHUP)" in hypercorn.log) is not nohup, hypercorn.text()
    assert b"Traceback" not in hypercorn.log and b"exiting now" not in hypercorn.log, hypercorn.text()


async def test_a_viewer_that_reads_nothing_does_not_hold_hypercorns_exit() -> None:
    """A viewer whose process froze (its kernel takes nothing more) while frames stream: hypercorn's trio worker wrote
    to it shielded and with no deadline, and waited for that write as it stopped, so after SIGTERM the drain was done
    at once and hypercorn never exited (a second SIGTERM to its supervisor did nothing either; 10 minutes watched).
    Each write now has the room sockets' deadline, and the viewer is let go at it."""
    async with streaming(["--worker-class", "trio"], CHUNKLINE_PIPELINE="pipelines/toy_world") as run:
        hypercorn = run.hypercorn
        async with httpx.AsyncClient(base_url=hypercorn.url, timeout=10) as client:
            response = await client.post(f"{SESSIONS}/{run.session_id}/tokens", json={"identity": "frozen"})
            assert response.status_code == 200, response.text
            viewer = response.json()
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: its buffers fill at once
        await sock.connect(("127.0.0.1", int(hypercorn.url.rsplit(":", 1)[1])))
        frozen = trio.SocketStream(sock)
        await frozen.send_all(f"GET {viewer['websocket_path']}?token={viewer['token']} HTTP/1.1\r\nHost: x\r\n"
                              "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                              "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode())  # then reads nothing
        with trio.fail_after(START_DEADLINE):  # frames stream on (the controller holds a key) past what it can take
            await run.controller.send_json({"topic": "tf.control", "payload": {"type": "control_state",
                                                                               "controls": ["w"]}})
            seen = sum(status_of(m) == "chunk" for m in run.heard)
            while sum(status_of(m) == "chunk" for m in run.heard) < seen + 20:
                run.heard.append(await run.controller.receive())
        hypercorn.process.send_signal(signal.SIGTERM)
        try:
            assert await hypercorn.ended() == 0, hypercorn.text()
        finally:
            await frozen.aclose()
            await run.controller.aclose()
