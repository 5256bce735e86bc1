"""``hypercorn server:app`` in a process of its own, with the replay pipeline: for the bounds the app itself keeps
where no front stands before it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx

ROOT = Path(__file__).resolve().parents[2]
RUNNING = re.compile(rb"Running on (http://127\.0\.0\.1:(\d+))")
START_DEADLINE = 120.0  # wall seconds: hypercorn's worker imports the server and loads the replay pipeline
STOP_DEADLINE = 60.0  # wall seconds for its drain and exit (the sessions' grace is 20 s)


@attrs.define
class PlainHypercorn:
    url: str
    port: int
    log: bytearray

    def text(self) -> str:
        return self.log.decode(errors="replace")


@contextlib.contextmanager
def plain_hypercorn(worker_class: str) -> Iterator[PlainHypercorn]:
    """Serving (its worker has loaded the pipeline) until the block ends; then stopped with SIGTERM, as a service
    manager stops it (killed with its process group, hypercorn's supervisor and its resource tracker left the
    supervisor's semaphores in /dev/shm, which other tests' checks for leftovers then found)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    env.update(CHUNKLINE_PIPELINE="pipelines/replay", CHUNKLINE_CONTROLLER_TIMEOUT="3600",
               CHUNKLINE_ROOM_EMPTY_TIMEOUT="3600", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    process = subprocess.Popen(
        [sys.executable, "-m", "hypercorn", "--worker-class", worker_class, "--bind", "127.0.0.1:0", "server:app"],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True)
    log = bytearray()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            log.extend(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        give_up = time.monotonic() + START_DEADLINE
        while (running := RUNNING.search(bytes(log))) is None:
            assert process.poll() is None and time.monotonic() < give_up, log.decode(errors="replace")
            time.sleep(0.05)  # bench-cost: real-time poll of hypercorn's log as it starts
        url = running.group(1).decode()
        while httpx.get(f"{url}/v1/service/ready", timeout=30).status_code != 200:
            assert time.monotonic() < give_up, log.decode(errors="replace")
            time.sleep(0.1)  # bench-cost: real-time poll until the worker loaded its pipeline
        yield PlainHypercorn(url, int(running.group(2)), log)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_DEADLINE)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        reader.join(10.0)
        assert process.stderr is not None
        process.stderr.close()
