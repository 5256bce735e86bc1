"""A second SIGTERM to an authority whose workers are agents (``--workers local``) aborts it as it aborts a server
with in-process workers: exit 128 + the first signal, one line, its local agents gone with it.

Before: the abort asked every worker to end its service process now, and an agent's stand-in in the authority
had no such call: the signal handler raised AttributeError, printed a traceback and the server exited 1.
"""

from __future__ import annotations

import signal

import trio

from ..reliability.helpers import pid_alive
from .conftest import START_DEADLINE, start_cluster, until, wait_for

EXIT_DEADLINE = 30.0  # wall seconds: an abort is at once; a margin for a loaded host


async def test_a_second_sigterm_to_an_authority_with_agents_aborts_it_with_143() -> None:
    cluster = start_cluster(workers=1)
    try:
        agents = [worker["pid"] for worker in cluster.workers()]
        # a client still sending its request head holds the shutdown after the drain (the front waits for its
        # connections), so the second signal finds the process on its way out, not gone
        with trio.socket.socket() as sock:
            await sock.connect(("127.0.0.1", cluster.port))
            await sock.send(b"GET /v1/stream/health HTTP/1.1\r\n")
            process = cluster.process.popen
            process.send_signal(signal.SIGTERM)
            await until(lambda: b"shutdown complete" in cluster.process.raw, "the drain's end", cluster,
                        deadline=START_DEADLINE)
            process.send_signal(signal.SIGTERM)
            await until(lambda: process.poll() is not None, "the abort", cluster, deadline=EXIT_DEADLINE)
            rc = process.returncode
        text = cluster.process.text()
        assert rc == 128 + signal.SIGTERM, text
        assert "exiting now (exit 143)" in text and "Traceback" not in text, text
        for pid in agents:
            wait_for(lambda pid=pid: not pid_alive(pid), f"agent pid {pid} to end with the authority", deadline=30)
    finally:
        cluster.http.close()
        cluster.process.stop()
