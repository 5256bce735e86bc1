"""A second SIGTERM to ``chunkline stream-serve`` after its drain, while the process is still on its way out, with
the toy world's stages in rank processes (their tensors in /dev/shm): the process ends at once with the first
signal's code and leaves no shared-memory segment behind, its own or its service process's.

Before: past the drain the server no longer listened for signals, so the second one ended it by its default
action, and each of the 60-odd segments of the session's channels stayed in /dev/shm; with ``--worker-mode
process`` the abort ended the server but the service process died by its parent-death signal, leaving its own.
"""

from __future__ import annotations

import re
import signal
import subprocess

import httpx
import pytest
import trio

from .helpers import (CPU_PLACEMENT, REPO_ROOT, RawWebSocket, channel_segments, process_tree, segment_owner,
                      stream_serve_command, stream_serve_env)
from ..processes import end_process

SERVING = re.compile(rb"chunkline: serving \S+ on (http://127\.0\.0\.1:(\d+))")
START_DEADLINE = 180.0  # wall seconds: the service and its ranks import torch and build the model (a loaded host)
EXIT_DEADLINE = 60.0


@pytest.mark.parametrize("worker_mode", ["in-process", "process"])
async def test_a_second_sigterm_after_the_drain_ends_the_server_and_leaves_no_shared_memory(worker_mode: str) -> None:
    command = stream_serve_command("pipelines/toy_world", "--port", "0", "--placement", CPU_PLACEMENT,
                                   "--worker-mode", worker_mode)
    before = channel_segments()
    process = await trio.lowlevel.open_process(command, cwd=REPO_ROOT, env=stream_serve_env(), stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = bytearray()
    changed = trio.Event()
    closed = False  # the process closed its log (it ended)

    async def read_log() -> None:
        nonlocal changed, closed
        assert process.stderr is not None
        async for data in process.stderr:
            log.extend(data)
            changed.set()
            changed = trio.Event()
        closed = True
        changed.set()

    async def logged(pattern: bytes) -> re.Match[bytes]:
        """Wait until the log shows ``pattern``."""
        while (found := re.search(pattern, log)) is None:
            assert not closed, f"the server ended before logging {pattern!r}:\n{log.decode(errors='replace')[-3000:]}"
            await changed.wait()
        return found

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_log)
            with trio.fail_after(START_DEADLINE):
                serving = await logged(SERVING.pattern)
                base, port = serving.group(1).decode(), int(serving.group(2))
                async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                    while (await client.get("/v1/service/ready")).status_code != 200:
                        await trio.sleep(0.1)  # bench-cost: a real server loads its pipeline, bounded
                    created = (await client.post("/v1/stream/sessions", json={"identity": "ctl"})).json()
                ws = await RawWebSocket.connect("127.0.0.1", port,
                                                f"{created['websocket_path']}?token={created['token']}")
                while True:  # until the session streams: its channels exist
                    message = await ws.receive()
                    if isinstance(message, dict) and message.get("topic") == "tf.status" \
                            and message["payload"].get("type") == "chunk":
                        break
            # the server's and its service process's (not those of other tests' processes running meanwhile)
            ours = {segment_owner(name) for name in channel_segments() - before} & process_tree(process.pid)
            assert ours, "the session's channels hold segments in /dev/shm"
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(EXIT_DEADLINE):
                await logged(rb"shutdown complete")
            process.send_signal(signal.SIGTERM)  # the drain is over; the process is still on its way out
            await ws.aclose()
            with trio.fail_after(EXIT_DEADLINE):
                rc = await process.wait()
            text = log.decode(errors="replace")[-3000:]
            # ended by the second signal (143, "exiting now") or, had it come too late, by itself (0): never by the
            # signal's default action (-15), and either way nothing is left
            assert rc in (0, 143), text
            assert rc == 0 or "exiting now" in text, text
            left = sorted(name for name in channel_segments() - before if segment_owner(name) in ours)
            assert not left, f"{len(left)} segments left: {left[:5]}\n{text}"
            nursery.cancel_scope.cancel()
    finally:
        await end_process(process)
