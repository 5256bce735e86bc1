"""The REST API as a new user meets it: a real ``chunkline stream-serve`` process, real HTTP on loopback.

Each refusal is a 4xx naming what was wrong and changes nothing; nothing a client sends is taken and ignored.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

ROOT = Path(__file__).resolve().parents[2]
START_DEADLINE = 120.0  # wall seconds: a loaded 2-core host imports the server stack
EXIT_DEADLINE = 30.0
SERVING = re.compile(rb"chunkline: serving \S+ on (http://\S+)")
SESSIONS = "/v1/stream/sessions"


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """``chunkline stream-serve pipelines/replay`` on a free loopback port, ready; stopped with SIGTERM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    env.update(PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "server.cli", "stream-serve", "pipelines/replay", "--port", "0", "--queue-size", "2"]
    process = await trio.lowlevel.open_process(command, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = bytearray()
    try:
        with trio.fail_after(START_DEADLINE):
            assert process.stderr is not None
            while not SERVING.search(log):
                data = await process.stderr.receive_some()
                assert data, f"the server exited:\n{log.decode(errors='replace')[-3000:]}"
                log += data
        url = SERVING.search(log).group(1).decode()  # type: ignore[union-attr]
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            with trio.fail_after(START_DEADLINE):
                while (await http.get("/v1/service/ready")).status_code != 200:
                    await trio.sleep(0.05)  # bench-cost: the subprocess loads its pipeline
            yield http
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(EXIT_DEADLINE):
                await process.wait()
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()


async def test_the_session_list_refuses_a_query_it_would_ignore(client: httpx.AsyncClient) -> None:
    """``?stauts=running`` listed every session and ``?status=running&status=closed`` the running ones only,
    both with a 200: a misspelt or repeated filter was taken and ignored."""
    created = await client.post(SESSIONS, json={"identity": "ctl"})
    assert created.status_code == 200, created.text
    everything = (await client.get(SESSIONS)).json()["sessions"]
    assert [s["session_id"] for s in everything] == [created.json()["session_id"]]
    for query, words in [("stauts=running", ("unknown query parameter", "'stauts'", "'status'")),
                         ("status=running&status=closed", ("status is given 2 times",)),
                         ("status=bogus", ("unknown status", "'bogus'")),
                         ("status=closed&limit=5", ("'limit'",))]:
        response = await client.get(f"{SESSIONS}?{query}")
        assert response.status_code == 400, (query, response.text)
        body = response.json()
        assert body["error"] == "invalid_query" and all(word in body["detail"] for word in words), (query, body)
    assert (await client.get(SESSIONS)).json()["sessions"] == everything  # nothing changed
    running = await client.get(f"{SESSIONS}?status={everything[0]['status']}")
    assert [s["session_id"] for s in running.json()["sessions"]] == [created.json()["session_id"]]
