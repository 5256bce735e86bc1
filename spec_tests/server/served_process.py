"""A real ``chunkline stream-serve`` process for the tests that meet the server as a user does (its exit, its API).

It runs the replay pipeline on a free loopback port with ``TMPDIR`` set to a short folder of the test's own
(the ``short_tmp`` fixture of ``conftest.py``): the server keeps hypercorn's Unix socket there, whose path may be 107 bytes at most.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

from .conftest import png_bytes
from ..processes import end_process

__all__ = ["DRAINING", "EXIT_DEADLINE", "Served", "stream_serve"]

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

    async def wait_ready(self, client: httpx.AsyncClient) -> None:
        """Until the server answers ready (it loads its pipeline first)."""
        with trio.fail_after(START_DEADLINE):
            while (await client.get("/v1/service/ready")).status_code != 200:
                await trio.sleep(0.05)  # bench-cost: the subprocess loads its pipeline

    async def upload(self) -> None:
        """A session with an uploaded image: the server writes it to a file of its upload folder."""
        body = {"identity": "ctl", "image_b64": base64.b64encode(png_bytes()).decode()}
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as client:
            await self.wait_ready(client)
            response = await client.post("/v1/stream/sessions", json=body)
        assert response.status_code == 200, response.text

    async def exit_code(self) -> int:
        with trio.move_on_after(EXIT_DEADLINE):
            return await self.process.wait()
        raise AssertionError(f"no exit within {EXIT_DEADLINE:g} s:\n{self.text()}")


@asynccontextmanager
async def stream_serve(
    tmp: Path, *options: str, pipeline: str = "pipelines/replay", wrapper: Sequence[str] = ()
) -> AsyncIterator[Served]:
    """The server of ``pipeline`` with ``options`` added to its command line; killed on exit if it still runs.
    ``wrapper``: a command that runs it in place (it execs the server: ``prlimit --nofile=...``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    env.update(TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    command = [*wrapper, sys.executable, "-m", "server.cli", "stream-serve", pipeline, "--port", "0", *options]
    process = await trio.lowlevel.open_process(command, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    served = Served(process)
    try:
        await served.read_until(SERVING)
        served.url = SERVING.search(served.log).group(1).decode()  # type: ignore[union-attr]
        yield served
    finally:
        await end_process(process)
