"""``chunkline stream-serve`` leaves nothing in the temporary directory, however it ends.

Each test runs the real command with ``TMPDIR`` set to a folder of its own, uploads a reference image (the
one thing the server keeps on disk), ends the server, and reads the folder: empty after SIGTERM, after a
second signal during the drain (which ends the process at once), and hypercorn's socket is never a file
(it is in the abstract namespace, so not even SIGKILL can leave it behind). The upload folder a SIGKILL
leaves is removed by the next server's first upload. A port it cannot listen on is test_serve_startup's.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from .conftest import png_bytes

ROOT = Path(__file__).resolve().parents[2]
START_DEADLINE = 120.0  # wall seconds: a loaded 2-core host imports the server stack
EXIT_DEADLINE = 30.0
SERVING = re.compile(rb"chunkline: serving \S+ on (http://\S+)")
DRAINING = b"shutting down: draining"


class Served:
    """One ``chunkline stream-serve`` process and what it has logged."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.log = bytearray()
        self.url = ""

    async def read_until(self, pattern: re.Pattern[bytes] | bytes) -> None:
        assert self.process.stderr is not None
        with trio.fail_after(START_DEADLINE):
            while not (pattern.search(self.log) if isinstance(pattern, re.Pattern) else pattern in self.log):
                data = await self.process.stderr.receive_some()
                assert data, f"the server exited:\n{self.text()}"
                self.log += data

    def text(self) -> str:
        return self.log.decode(errors="replace")[-3000:]

    async def upload(self) -> None:
        """A session with an uploaded image: the server writes it to a file of its upload folder."""
        body = {"identity": "ctl", "image_b64": base64.b64encode(png_bytes()).decode()}
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as client:
            with trio.fail_after(START_DEADLINE):
                while (await client.get("/v1/service/ready")).status_code != 200:
                    await trio.sleep(0.05)  # bench-cost: the subprocess loads its pipeline
            response = await client.post("/v1/stream/sessions", json=body)
        assert response.status_code == 200, response.text

    async def exit_code(self) -> int:
        with trio.move_on_after(EXIT_DEADLINE):
            return await self.process.wait()
        raise AssertionError(f"no exit within {EXIT_DEADLINE:g} s:\n{self.text()}")


@asynccontextmanager
async def stream_serve(tmp: Path) -> AsyncIterator[Served]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    env.update(TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "server.cli", "stream-serve", "pipelines/replay", "--port", "0"]
    process = await trio.lowlevel.open_process(command, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    served = Served(process)
    try:
        await served.read_until(SERVING)
        served.url = SERVING.search(served.log).group(1).decode()  # type: ignore[union-attr]
        yield served
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()


def left_in(tmp: Path) -> list[str]:
    return sorted(path.name for path in tmp.iterdir())


def backend_sockets(pid: int) -> list[str]:
    """The abstract-namespace sockets named after the server ``pid`` (hypercorn's, behind the front)."""
    with open("/proc/net/unix") as table:
        return [line.split()[-1] for line in table if f"@chunkline-front-{pid}-" in line]


async def test_sigterm_leaves_nothing_and_the_backend_socket_is_never_a_file(tmp_path: Path) -> None:
    async with stream_serve(tmp_path) as served:
        await served.upload()
        assert [name.split("-")[:3] for name in left_in(tmp_path)] == [["chunkline", "uploads", str(served.process.pid)]]
        assert len(backend_sockets(served.process.pid)) >= 1  # listening in the abstract namespace
        served.process.send_signal(signal.SIGTERM)
        assert await served.exit_code() == 0, served.text()
    assert left_in(tmp_path) == []
    assert backend_sockets(served.process.pid) == []


@pytest.mark.parametrize(("first", "second"), [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM),
                                               (signal.SIGTERM, signal.SIGINT)])
async def test_a_second_signal_during_the_drain_exits_at_once_and_leaves_nothing(
    tmp_path: Path, first: signal.Signals, second: signal.Signals
) -> None:
    async with stream_serve(tmp_path) as served:
        await served.upload()
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        async with await trio.open_tcp_stream(host, int(port)):  # an idle connection: the drain waits for it
            served.process.send_signal(first)
            await served.read_until(DRAINING)
            served.process.send_signal(second)
            assert await served.exit_code() == 128 + first, served.text()
        await served.read_until(b"during the drain: exiting now")
    assert left_in(tmp_path) == []


async def test_the_upload_folder_a_killed_server_left_goes_with_the_next_servers_first_upload(tmp_path: Path) -> None:
    async with stream_serve(tmp_path) as killed:
        await killed.upload()
        killed.process.kill()
        assert await killed.exit_code() == -signal.SIGKILL
    assert [name.split("-")[:3] for name in left_in(tmp_path)] == [["chunkline", "uploads", str(killed.process.pid)]]
    async with stream_serve(tmp_path) as served:
        await served.upload()
        assert [name.split("-")[:3] for name in left_in(tmp_path)] == [["chunkline", "uploads", str(served.process.pid)]]
        served.process.send_signal(signal.SIGTERM)
        assert await served.exit_code() == 0, served.text()
    assert left_in(tmp_path) == []
