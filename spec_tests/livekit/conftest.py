"""A real LiveKit server, a real stream server and real SDK clients, all inside a private network namespace.

- ``livekit_server`` (one per module): a :class:`~server.livekit_local.PrivateNetwork` the module makes,
  the ``make livekit-server`` binary running inside it on the namespace's own address with its own key
  pair; at teardown the server is stopped (signal, then kill) and the fixture checks that no process was
  left inside before the namespace is removed.
- ``stream_server(**settings)``: ``chunkline stream-serve pipelines/toy_world --livekit-url ...`` started
  inside the namespace (the command a user runs), ready once ``/v1/service/ready`` answers; stopped at
  teardown.
- ``agent``: SDK clients (controllers, viewers, the RoomService) in a process inside the namespace
  (:mod:`server.livekit_clients`), driven from the test over JSON lines.

The test process itself stays outside and reaches the namespace's address over the veth pair (HTTP only;
every WebRTC peer is inside). In CI (``CI=true``) a missing binary or missing root fails the tests;
elsewhere they skip with the reason (``make livekit-server``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from server.livekit_clients import Clients, open_clients
from server.livekit_local import (
    LiveKitConfig,
    LiveKitNotBuilt,
    PrivateNetwork,
    find_livekit_server,
    running_livekit,
    stop_process,
    wait_http_ok,
)

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}
CHUNKLINE = Path(sys.executable).with_name("chunkline")
STREAM_READY_TIMEOUT = 60.0  # a cold torch import on a loaded machine
REPORT_DEADLINE = 15.0  # wall seconds for who is in a room to reach a session's record (a hang bound on a loaded host)
SESSIONS = "/v1/stream/sessions"


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"CI=true: the LiveKit tests must run, never skip: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def livekit_binary() -> Path:
    try:
        binary = find_livekit_server()
    except LiveKitNotBuilt as exc:
        _unavailable(str(exc))
    if os.geteuid() != 0:
        _unavailable("the LiveKit tests make a network namespace, which needs root")
    return binary


@pytest.fixture(scope="module")
def artifacts(request: pytest.FixtureRequest) -> Path:
    base = os.environ.get("CHUNKLINE_ARTIFACTS")
    path = (Path(base) if base else ROOT / "test-artifacts") / "livekit" / request.module.__name__.rsplit(".", 1)[-1]
    path.mkdir(parents=True, exist_ok=True)
    return path


@attrs.frozen
class LiveKit:
    network: PrivateNetwork
    config: LiveKitConfig
    process: subprocess.Popen[bytes]
    workdir: Path


@pytest.fixture(scope="module")
def livekit_server(livekit_binary: Path, artifacts: Path) -> Iterator[LiveKit]:
    network = PrivateNetwork.create()
    left: list[int] = []
    try:
        config = LiveKitConfig(bind=network.inner_ip, node_ip=network.inner_ip)
        with running_livekit(config, artifacts, prefix=network.prefix(), binary=livekit_binary) as process:
            yield LiveKit(network, config, process, artifacts)
        left = network.pids()
    finally:
        network.destroy()
    assert not left, f"processes left in the namespace {network.name}: {left}"


@attrs.define
class StreamServer:
    """One ``chunkline stream-serve`` inside the namespace; ``url`` is reachable from the test."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=10.0, trust_env=False)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


async def counted(stream: StreamServer, session_id: str, count: int) -> dict[str, Any]:
    """The session's record once it counts ``count`` participants (HTTP polls of a real server: who is in a LiveKit
    room reaches the record from another process, over the network)."""
    async with stream.http() as http:
        with trio.move_on_after(REPORT_DEADLINE):
            while (record := (await http.get(f"{SESSIONS}/{session_id}")).json())["participant_count"] != count:
                await trio.sleep(0.1)  # bench-cost: the room is seen from another process over the network
            return record
    raise AssertionError(f"session {session_id} counts {record['participant_count']}, not {count}: {record}\n"
                         f"{stream.log_tail()}")


@pytest.fixture(scope="module")
def stream_servers(livekit_server: LiveKit) -> Iterator[Callable[..., StreamServer]]:
    """``stream_servers(**flags)``: a started stream server (flags as ``--name value``), stopped at module end."""
    started: list[StreamServer] = []
    port = [8100]

    def start(**flags: Any) -> StreamServer:
        lk, network = livekit_server.config, livekit_server.network
        port[0] += 1
        argv = [str(CHUNKLINE), "stream-serve", "pipelines/toy_world", "--host", network.inner_ip, "--port", str(port[0])]
        for name, value in flags.items():
            argv += [f"--{name.replace('_', '-')}", str(value)]
        env = {**os.environ, "CHUNKLINE_LIVEKIT_URL": lk.url, "CHUNKLINE_LIVEKIT_API_KEY": lk.api_key,
               "CHUNKLINE_LIVEKIT_API_SECRET": lk.api_secret, "PYTHONUNBUFFERED": "1"}
        log = livekit_server.workdir / f"stream-serve-{port[0]}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen([*network.prefix(), *argv], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        server = StreamServer(f"http://{network.inner_ip}:{port[0]}", process, log)
        started.append(server)
        try:
            wait_http_ok(server.url + "/v1/service/ready", STREAM_READY_TIMEOUT, process)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{server.log_tail()}") from None
        return server

    try:
        yield start
    finally:
        for server in started:
            stop_process(server.process, signals=(signal.SIGINT, signal.SIGTERM), grace=10.0)


@pytest.fixture
async def agent(livekit_server: LiveKit, artifacts: Path) -> AsyncIterator[Clients]:
    """SDK clients in a process inside the namespace (:mod:`server.livekit_clients`)."""
    async with open_clients(livekit_server.config, livekit_server.network.prefix(), artifacts / "clients.stderr.log") as clients:
        yield clients

