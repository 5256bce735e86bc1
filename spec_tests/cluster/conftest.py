"""A real cluster for the agent tests: ``chunkline stream-serve --workers local`` in its own process,
its agents in theirs, talked to over HTTP and the local rooms' WebSocket like any user would.

The authority is module-scoped (agents take seconds to import torch); each test starts by waiting
until the fleet it needs is ready, and leaves the cluster with its slots replaced. Waits on other
processes are real-time polls, bounded by a deadline.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from server.transport.client import RoomClient

from ..reliability.helpers import pid_alive

ROOT = Path(__file__).resolve().parents[2]
TINY = "spec_tests/cluster/tiny_world.py"
TOKEN = "cluster-test-token-0123456789"
START_DEADLINE = 240.0  # wall seconds: an agent imports torch and builds its model (slow on a loaded 2-core host)
INTERVAL, DEADLINE = 0.5, 4.0  # heartbeat interval and deadline of the test authority
SERVING = re.compile(rb"chunkline: serving \S+ on (http://127\.0\.0\.1:(\d+))")
#: the authority's log line naming the port its agents dial (it binds any free one: --cluster-port 0)
AGENTS_DIAL = re.compile(rb"cluster: agents dial (?:tcp|tls)://\S+:(\d+) ")


def free_port() -> int:
    """A port free now, for a process that must be told its port before it starts (one that can bind 0 and say which
    port it took is started with 0): another process (xdist's other workers) may take it before that one binds it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: the sockets that hold :func:`unserved_port`'s ports, closed as the session ends
_UNSERVED: list[socket.socket] = []


def unserved_port() -> int:
    """A port on 127.0.0.1 that no one listens on for the rest of the session: it is bound here and never listened on,
    so a dial to it is refused, and no other process can take it meanwhile (a port merely free now can be)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _UNSERVED.append(sock)
    return sock.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def _unserved_ports_released() -> Iterator[None]:
    yield
    while _UNSERVED:
        _UNSERVED.pop().close()


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class Process:
    """A child process whose stderr is kept (bounded) for assertion messages."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(command, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._log = bytearray()
        self._reader = threading.Thread(target=self._read, name=f"log of pid {self.popen.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stderr is not None
        try:
            for line in self.popen.stderr:
                self._log += line
                if len(self._log) > 2_000_000:
                    del self._log[:1_000_000]
        except ValueError:  # the pipe was closed under the reader at teardown
            return

    @property
    def raw(self) -> bytes:
        return bytes(self._log)

    def text(self, tail: int = 6000) -> str:
        return self._log.decode(errors="replace")[-tail:]

    def stop(self, grace: float = 30.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._reader.join(5)
        if self.popen.stderr is not None and not self._reader.is_alive():
            self.popen.stderr.close()
        return self.popen.returncode


def chunkline(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())", *args]


class Cluster:
    def __init__(self, process: Process, base_url: str, cluster_port: int) -> None:
        self.process = process
        self.base_url = base_url
        self.port = int(base_url.rsplit(":", 1)[1])
        self.cluster_port = cluster_port
        self.http = httpx.Client(base_url=base_url, timeout=10)

    def get(self, path: str) -> Any:
        return self.http.get(path).json()

    def workers(self) -> list[dict[str, Any]]:
        return self.get("/v1/stream/health")["workers"]

    def eligible(self) -> list[dict[str, Any]]:
        return [w for w in self.workers() if w["state"] in ("idle", "busy")]

    def stop(self) -> None:
        """Stop the authority; it must exit cleanly (its log says why not)."""
        self.http.close()
        rc = self.process.stop()
        assert rc == 0, f"the authority exited with {rc}:\n{self.process.text()}"


def start_cluster(*extra: str, workers: int = 2, launcher: str = "local", pipeline: str = TINY,
                  tmpdir: Path | None = None) -> Cluster:
    cluster = start_authority(*extra, workers=workers, launcher=launcher, pipeline=pipeline, tmpdir=tmpdir)
    try:
        wait_for(lambda: len(cluster.eligible()) >= workers, f"{workers} ready agents", cluster)
    except BaseException:  # a fixture's setup that fails never reaches its teardown: the authority outlived the run
        cluster.http.close()
        cluster.process.stop()
        raise
    return cluster


def start_authority(*extra: str, workers: int = 2, launcher: str = "local", pipeline: str = TINY,
                    tmpdir: Path | None = None, token: str | None = TOKEN) -> Cluster:
    """The authority serving HTTP and its cluster port; its agents may still be on their way. Both ports are
    the authority's own pick (0: no port chosen here can be taken by another process before it binds it).
    ``tmpdir``: the temporary directory of the authority and its local agents (their folders go there). ``token``:
    the cluster token in its environment (None: the authority makes its own)."""
    command = chunkline("stream-serve", pipeline, "--port", "0", "--workers", launcher, "--num-workers", str(workers),
                        "--max-sessions-per-worker", "1", "--queue-size", "4", "--cluster-port", "0",
                        "--heartbeat-interval", str(INTERVAL), "--heartbeat-deadline", str(DEADLINE),
                        "--controller-timeout", "60", "--room-empty-timeout", "60", *extra)
    scratch = {} if tmpdir is None else {"TMPDIR": str(tmpdir)}
    given = {} if token is None else {"CHUNKLINE_CLUSTER_TOKEN": token}
    process = Process(command, clean_env(**given, **scratch))
    give_up = time.monotonic() + START_DEADLINE
    while not ((serving := SERVING.search(process.raw)) and (dial := AGENTS_DIAL.search(process.raw))):
        if process.popen.poll() is not None or time.monotonic() > give_up:
            process.stop()
            raise AssertionError(f"the authority did not start:\n{process.text()}")
        time.sleep(0.05)  # bench-cost: real-time poll of another process, bounded by a deadline
    return Cluster(process, serving.group(1).decode(), int(dial.group(1)))


def agent_dialing(port: int, *args: str, pipeline: str = TINY) -> Process:
    """A ``chunkline worker`` process dialing the cluster port ``port`` on this host with the test token."""
    return Process(chunkline("worker", pipeline, "--authority", f"tcp://127.0.0.1:{port}", *args),
                   clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))


@asynccontextmanager
async def external_agent(*extra: str, agent_args: tuple[str, ...] = ()) -> AsyncIterator[tuple[Cluster, Process]]:
    """An authority that launches no agents (``extra``: its options) and one external agent dialing it (``agent_args``:
    its options), ready; afterwards the agent stops, then the authority, which must exit cleanly."""
    authority = await trio.to_thread.run_sync(lambda: start_authority(*extra, launcher="external", workers=1))
    agent = agent_dialing(authority.cluster_port, *agent_args)

    def ready() -> list[dict[str, Any]]:
        found = authority.eligible()
        if not found and agent.popen.poll() is not None:  # it will never be: say why now, not at START_DEADLINE
            raise AssertionError(f"the external agent exited with {agent.popen.returncode} before it was ready:\n"
                                 f"{agent.text()}\n--- the authority:\n{authority.process.text()}")
        return found

    try:
        await until(ready, "the external agent to be ready", authority)
        yield authority, agent
    finally:
        agent.stop()
        await trio.to_thread.run_sync(authority.stop)


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """Process ``pid`` stopped (SIGSTOP: frozen, its sockets open) for the block, and continued after it, whatever
    happens in it."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_for(predicate: Any, what: str, cluster: Cluster | None = None, deadline: float = START_DEADLINE) -> Any:
    """Synchronous bounded real-time poll (fixtures)."""
    give_up = time.monotonic() + deadline
    while True:
        found = predicate()
        if found:
            return found
        if time.monotonic() > give_up:
            log = cluster.process.text() if cluster is not None else ""
            raise AssertionError(f"timed out after {deadline:g} s waiting for {what}\n{log}")
        time.sleep(0.1)  # bench-cost: real-time poll of other processes, bounded by a deadline


async def until(predicate: Any, what: str, cluster: Cluster | None = None, deadline: float = START_DEADLINE) -> Any:
    """Async bounded real-time poll; the predicate may be async."""
    give_up = time.monotonic() + deadline
    while True:
        found = predicate()
        if hasattr(found, "__await__"):
            found = await found
        if found:
            return found
        if time.monotonic() > give_up:
            log = cluster.process.text() if cluster is not None else ""
            raise AssertionError(f"timed out after {deadline:g} s waiting for {what}\n{log}")
        await trio.sleep(0.05)  # bench-cost: real-time poll of other processes, bounded by a deadline


@pytest.fixture(scope="module")
def external_authority() -> Iterator[Cluster]:
    """An authority that launches no agents (``--workers external``, one expected): a module's tests dial it."""
    found = start_authority(launcher="external", workers=1)
    try:
        yield found
    finally:
        found.stop()


@pytest.fixture(scope="module")
def one_agent_cluster() -> Iterator[Cluster]:
    """A ``--workers local`` authority with one agent: a module's tests share it."""
    found = start_cluster(workers=1)
    try:
        yield found
    finally:
        found.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    found = start_cluster()
    try:
        yield found
    finally:
        pids = [w["pid"] for w in found.workers() if w.get("pid")] if found.process.popen.poll() is None else []
        found.stop()
        for pid in pids:
            wait_for(lambda pid=pid: not _alive(pid), f"agent pid {pid} to exit after the authority", deadline=30)


_alive = pid_alive


class Controller:
    """A session's controller in its room: creates it over HTTP, joins, holds a key once it runs."""

    def __init__(self, session: dict[str, Any], ws: RoomClient) -> None:
        self.session = session
        self.ws = ws
        self.inbox: list[Any] = []
        self.frames = 0
        # one reader all along, so pings are answered while the test does other things (the room sends a
        # silent peer away); messages wait here until the test reads them
        self._arrived, self._messages = trio.open_memory_channel[Any](math.inf)
        trio.lowlevel.spawn_system_task(self._read)

    async def _read(self) -> None:
        try:
            while (message := await self.ws.receive()) is not None:
                self._arrived.send_nowait(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:  # also when the test's run ends without closing it (a failed test): no socket left to the GC
            with trio.CancelScope(shield=True):
                await self.ws.aclose()
        self._arrived.send_nowait(None)

    @property
    def session_id(self) -> str:
        return self.session["session_id"]

    @classmethod
    async def open(cls, client: httpx.AsyncClient, cluster: Cluster, identity: str) -> Controller:
        response = await client.post("/v1/stream/sessions", json={"identity": identity})
        assert response.status_code in (200, 202), response.text
        created = response.json()
        ws = await RoomClient.connect("127.0.0.1", cluster.port, f"{created['websocket_path']}?token={created['token']}")
        return cls(created, ws)

    async def next(self) -> Any:
        try:
            message = await self._messages.receive()
        except trio.EndOfChannel:
            return None
        if message is None:
            self._arrived.close()  # the room closed: every later next() says so too
            return None
        if isinstance(message, bytes):
            self.frames += 1
        elif message is not None:
            self.inbox.append(message)
            payload = message.get("payload") if isinstance(message, dict) else None
            if isinstance(payload, dict) and payload.get("stage") == "running":
                await self.ws.send_json({"topic": "tf.control",
                                         "payload": {"type": "control_state", "controls": ["w"]}})
        return message

    def statuses(self, kind: str) -> list[dict[str, Any]]:
        return [m["payload"] for m in self.inbox if isinstance(m, dict) and m.get("topic") == "tf.status"
                and m["payload"].get("type") == kind]

    def left(self, identity: str) -> bool:
        return any(m.get("type") == "participant_left" and m.get("identity") == identity
                   for m in self.inbox if isinstance(m, dict))

    async def stream(self, frames: int, deadline: float = 120.0) -> None:
        """Read until ``frames`` video frames arrived (the session runs on its worker)."""
        with trio.fail_after(deadline):
            while self.frames < frames:
                if await self.next() is None:
                    raise AssertionError(f"the room closed after {self.frames} frames: {self.inbox[-3:]}")

    async def drain_inbox(self, seconds: float) -> None:
        with trio.move_on_after(seconds):
            while await self.next() is not None:
                pass
