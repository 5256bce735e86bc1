"""A server whose ``--ray-address`` answers nothing serves (its slots starting) and stops at once on SIGTERM.

Ray's connect to such an address goes on for minutes, and it ran inside the server's start: no ``serving`` line,
health unreachable, a SIGTERM heard by nothing until hypercorn gave up on the start a minute on (a traceback, exit
1), or until the shutdown's 55 s bound. Now the start does not wait for Ray: the server serves, says it connects to
Ray, and a stop leaves the connect behind. A real ``chunkline stream-serve`` in a network of its own (``unshare -rn``:
loopback only, so Ray's connect and its look for the host's address reach nothing).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ..namespaces import unshare_or_skip
from ..reliability.test_held_loop_stops import ROOT, START_DEADLINE, URL

pytestmark = pytest.mark.ray

LOOPBACK_ONLY = 'ip link set lo up && exec "$@"'
STOP_DEADLINE = 30.0  # wall seconds for the stop to end the process


def test_a_stop_while_ray_does_not_answer_ends_the_server_at_once() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    argv = unshare_or_skip("-rn", LOOPBACK_ONLY, sys.executable, "-m", "server.cli", "stream-serve",
                           "pipelines/toy_world", "--port", "47170", "--workers", "ray",
                           "--ray-address", "127.0.0.1:47171")  # nothing listens there
    server = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    log = b""
    try:
        assert server.stderr is not None
        os.set_blocking(server.stderr.fileno(), False)
        give_up = time.monotonic() + START_DEADLINE
        while URL.search(log) is None:  # it serves while Ray connects
            assert server.poll() is None and time.monotonic() < give_up, log.decode(errors="replace")
            log += server.stderr.read() or b""
            time.sleep(0.1)  # bench-cost: real-time poll of another process's log, bounded by a deadline
        assert b"cluster: connecting to Ray at 127.0.0.1:47171" in log
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=STOP_DEADLINE) == 0, log.decode(errors="replace")
        log += server.stderr.read() or b""
        assert b"Traceback" not in log and b"exceeded its bound" not in log, log.decode(errors="replace")
        # Ray's warning that its connect, on a thread, set no SIGTERM handler (the server keeps its own)
        assert b"SIGTERM handler is not set" not in log, log.decode(errors="replace")
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        if server.stderr is not None:
            server.stderr.close()


