"""``hypercorn server:app`` under its supervisor with ``CHUNKLINE_WORKER_MODE=process``: the model worker's service
child starts, a session streams, and every end of the supervisor leaves no process and no shared memory behind.

Before: hypercorn starts its worker as a daemonic multiprocessing process, which multiprocessing refuses any child,
so the service child never started ("daemonic processes are not allowed to have children") and the worker slot
failed until it gave up. And a supervisor killed with SIGKILL left its worker serving on as an orphan, with its
service child, until something killed it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Any

import httpx
import pytest
import trio

from server.transport.client import RoomClient

from ..processes import end_process
from ..reliability.helpers import channel_segments, pid_alive, process_tree, segment_owner
from .test_hypercorn import APP_TARGET, ROOT, RUNNING, SESSIONS, semaphores_left_behind, server_env, status_of

START_DEADLINE = 120.0  # wall seconds: the service child imports torch and loads the toy world (a loaded host)
EXIT_DEADLINE = 15.0  # from the signal to the supervisor's exit, and to the orphaned worker's drained end
GONE_DEADLINE = 5.0  # for the worker and its service child to be gone once the supervisor has exited


def below_the_worker(supervisor: int) -> list[int]:
    """The live processes two levels below hypercorn's supervisor: its worker's children (the service child)."""
    tree = process_tree(supervisor)
    workers = {pid for pid in tree if parent_of(pid) == supervisor}
    return [pid for pid in tree if parent_of(pid) in workers]


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):  # gone meanwhile
        return None


async def wait_ready(client: httpx.AsyncClient, log: bytearray) -> None:
    with trio.fail_after(START_DEADLINE):
        while (response := await client.get("/v1/service/ready")).status_code != 200:
            assert response.status_code == 503, response.text
            assert response.json()["workers_failed"] == 0, (response.text, log.decode(errors="replace")[-3000:])
            await trio.sleep(0.1)  # bench-cost: the service child imports torch and loads the toy world


def stop(process: trio.Process, how: str) -> None:
    if how == "SIGTERM":  # to the supervisor, as a service manager sends it
        process.send_signal(signal.SIGTERM)
    elif how == "Ctrl-C":  # to the terminal's whole process group
        os.killpg(process.pid, signal.SIGINT)
    else:  # the supervisor killed outright: its worker is orphaned
        process.send_signal(signal.SIGKILL)


@pytest.mark.parametrize(("worker_class", "how", "status"), [
    ("trio", "SIGTERM", 0), ("asyncio", "Ctrl-C", 0), ("trio", "supervisor SIGKILL", -signal.SIGKILL)])
async def test_supervised_hypercorn_runs_process_workers_and_every_stop_leaves_nothing(
        worker_class: str, how: str, status: int) -> None:
    before, semaphores = channel_segments(), set(os.listdir("/dev/shm"))
    command = [sys.executable, "-m", "hypercorn", "--worker-class", worker_class, "--bind", "127.0.0.1:0", APP_TARGET]
    env = server_env() | {"CHUNKLINE_PIPELINE": "pipelines/toy_world", "CHUNKLINE_WORKER_MODE": "process"}
    process = await trio.lowlevel.open_process(command, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                               start_new_session=True)
    log = bytearray()
    tree: set[int] = set()

    async def read_log() -> None:
        assert process.stderr is not None
        async for data in process.stderr:
            log.extend(data)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_log)
            with trio.fail_after(START_DEADLINE):
                while not RUNNING.search(log):
                    assert process.returncode is None, log.decode(errors="replace")[-3000:]
                    await trio.sleep(0.05)  # bench-cost: hypercorn spawns its worker, which imports the app
            url = RUNNING.search(log).group(1).decode()  # type: ignore[union-attr]
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                await wait_ready(client, log)
                response = await client.post(SESSIONS, json={"identity": "ctl"})
                assert response.status_code == 200, response.text
                live = response.json()
            port = int(url.rsplit(":", 1)[1])
            controller = await RoomClient.connect("127.0.0.1", port, f"{live['websocket_path']}?token={live['token']}")
            heard: list[Any] = []
            with trio.fail_after(START_DEADLINE):
                while not any(status_of(m) == "chunk" for m in heard):
                    heard.append(await controller.receive())
            tree = process_tree(process.pid)
            assert below_the_worker(process.pid), f"no service child:\n{log.decode(errors='replace')[-3000:]}"
            stop(process, how)
            with trio.move_on_after(EXIT_DEADLINE):
                while (message := await controller.receive()) is not None:
                    heard.append(message)
            await controller.aclose()
            with trio.move_on_after(EXIT_DEADLINE):
                await process.wait()
            assert process.returncode == status, (process.returncode, log.decode(errors="replace")[-3000:])
            with trio.move_on_after(GONE_DEADLINE):
                while left := [pid for pid in tree if pid_alive(pid)]:
                    await trio.sleep(0.05)  # bench-cost: real-time poll of processes that are not ours to wait on
            assert left == [], f"still running: {left}\n{log.decode(errors='replace')[-3000:]}"
            done = [m["payload"] for m in heard if status_of(m) == "done"]
            assert len(done) == 1 and done[0]["reason"] == "shutdown", log.decode(errors="replace")[-3000:]
            nursery.cancel_scope.cancel()
    finally:
        await end_process(process)
        for pid in tree - {process.pid}:  # a worker orphaned by the kill above, or one that did not end
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    ours = sorted(name for name in channel_segments() - before if segment_owner(name) in tree)
    assert ours == [], ours
    assert await semaphores_left_behind(semaphores) == []
    assert b"Traceback" not in log and b"daemonic" not in log, log.decode(errors="replace")[-3000:]
