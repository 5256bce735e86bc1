"""A stop signal to ``chunkline stream-serve``'s whole process group (systemd's default ``KillMode=control-group``,
``kill -TERM -PGID``, a closed terminal's SIGHUP) drains as one to the server alone does, with the toy world's stages
in rank processes and, with ``--worker-mode process``, in a service child above them: the live session's client
gets ``done`` (reason ``shutdown``), the server exits 0, and no process or /dev/shm segment is left.

The signal goes to every process of the tree, as systemd's cgroup kill sends it: the children lead process groups
of their own, which ``kill -PGID`` and a terminal do not reach.

Before: the signal reached the children too and killed some by its default action. A service child ignored SIGINT
and SIGTERM but not SIGHUP: a group SIGHUP killed it (and its ranks) at once, and the session failed (``error``,
``session_failed``) instead of draining. A rank ignored only SIGINT: SIGTERM or SIGHUP killed it too, which the toy
world's drain happens not to notice (it stops its session without another stage call; the ranks' own close never
ran); ``spec_tests/engine/test_workers.py`` shows the rank's side.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from typing import Any

import httpx
import pytest
import trio

from .helpers import (CPU_PLACEMENT, REPO_ROOT, RawWebSocket, channel_segments, kill_what_is_left, process_tree,
                      processes_left, segment_owner, stream_serve_command, stream_serve_env)
from ..processes import end_process
from ..server.test_hypercorn import status_of

SERVING = re.compile(rb"chunkline: serving \S+ on (http://127\.0\.0\.1:(\d+))")
START_DEADLINE = 180.0  # wall seconds: the ranks (and the service child) import torch and build the model
EXIT_DEADLINE = 30.0  # from the signal to the server's exit: a drain of one session (a chunk or two)
GONE_DEADLINE = 5.0  # for every process of the tree to be gone once the server has exited


CASES = [  # (worker mode, the signal to the group); every case's stages run in rank processes
    pytest.param("in-process", signal.SIGTERM, id="ranks-SIGTERM"),
    pytest.param("process", signal.SIGHUP, id="service-child-SIGHUP"),  # its ranks get it too
]


@pytest.mark.parametrize(("worker_mode", "signum"), CASES)
async def test_a_stop_signal_to_the_servers_process_group_drains_its_sessions(worker_mode: str, signum: int) -> None:
    command = stream_serve_command("pipelines/toy_world", "--port", "0", "--placement", CPU_PLACEMENT,
                                   "--worker-mode", worker_mode)
    before = channel_segments()
    process = await trio.lowlevel.open_process(command, cwd=REPO_ROOT, env=stream_serve_env(),
                                               stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                               start_new_session=True)  # its own process group, as under systemd
    log = bytearray()
    tree: set[int] = set()

    async def read_log() -> None:
        assert process.stderr is not None
        async for data in process.stderr:
            log.extend(data)

    def text() -> str:
        return log.decode(errors="replace")[-4000:]

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_log)
            with trio.fail_after(START_DEADLINE):
                while (serving := SERVING.search(log)) is None:
                    assert process.returncode is None, text()
                    await trio.sleep(0.05)  # bench-cost: a real server process starts (bounded)
                base, port = serving.group(1).decode(), int(serving.group(2))
                async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                    while (await client.get("/v1/service/ready")).status_code != 200:
                        await trio.sleep(0.1)  # bench-cost: a real server loads its pipeline, bounded
                    response = await client.post("/v1/stream/sessions",
                                                 json={"identity": "ctl", "config": {"continuous": True}})
                    assert response.status_code == 200, response.text
                    created = response.json()
                ws = await RawWebSocket.connect("127.0.0.1", port,
                                                f"{created['websocket_path']}?token={created['token']}")
                heard: list[Any] = []
                while sum(status_of(m) == "chunk" for m in heard) < 2:
                    heard.append(await ws.receive())
            tree = process_tree(process.pid)
            assert len(tree) > 2, f"the stages run in child processes: {tree}"
            signalled, after = time.monotonic(), len(heard)
            # every process of the tree, as systemd's control-group kill signals each (the children lead process
            # groups of their own, which a signal to the server's group, as from a terminal, does not reach)
            for pid in sorted(tree):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            with trio.move_on_after(EXIT_DEADLINE):
                while (message := await ws.receive()) is not None:
                    heard.append(message)
            await ws.aclose()
            with trio.move_on_after(EXIT_DEADLINE):
                await process.wait()
            took = time.monotonic() - signalled
            statuses = [status_of(m) for m in heard[after:] if status_of(m)]
            summary = (f"after the signal: {statuses} ({took:.1f} s to exit {process.returncode}); "
                       f"last {[m.get('payload', m) for m in heard[-2:] if isinstance(m, dict)]}\n{text()}")
            assert process.returncode == 0, summary
            done = [m["payload"] for m in heard if status_of(m) == "done"]
            assert len(done) == 1 and done[0]["reason"] == "shutdown" and "error" not in statuses, summary
            left = await processes_left(tree, GONE_DEADLINE)
            assert left == [], f"still running: {left}\n{text()}"
            ours = sorted(name for name in channel_segments() - before if segment_owner(name) in tree)
            assert ours == [], ours
            nursery.cancel_scope.cancel()
    finally:
        await end_process(process)
        kill_what_is_left(tree)
    assert b"Traceback" not in log, text()
