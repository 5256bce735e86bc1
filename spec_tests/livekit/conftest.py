"""A real LiveKit server, a real stream server and real SDK clients, all inside a private network namespace.

- ``livekit_server`` (one per module): a :class:`~server.livekit_local.PrivateNetwork` the module makes,
  the ``make livekit-server`` binary running inside it on the namespace's own address with its own key
  pair; at teardown the server is stopped (signal, then kill) and the fixture checks that no process was
  left inside before the namespace is removed.
- ``stream_server(**settings)``: ``chunkline stream-serve pipelines/toy_world --livekit-url ...`` started
  inside the namespace (the command a user runs), ready once ``/v1/service/ready`` answers; stopped at
  teardown.
- ``agent``: SDK clients (controllers, viewers, the RoomService) in a process inside the namespace
  (:mod:`spec_tests.livekit.agent`), driven from the test over JSON lines.

The test process itself stays outside and reaches the namespace's address over the veth pair (HTTP only;
every WebRTC peer is inside). In CI (``CI=true``) a missing binary or missing root fails the tests;
elsewhere they skip with the reason (``make livekit-server``).
"""

from __future__ import annotations

import json
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
REQUEST_TIMEOUT = 20.0  # one agent request (a join includes ICE)


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


class AgentError(RuntimeError):
    """The agent answered a request with an error (the SDK's words)."""


class Agent:
    """The driver side of :mod:`spec_tests.livekit.agent`: requests, and the events it reported."""

    def __init__(self, process: trio.Process, livekit: LiveKit) -> None:
        self.process = process
        self.livekit = livekit
        self.events: list[dict[str, Any]] = []
        self._replies: dict[int, dict[str, Any]] = {}
        self._arrived = trio.Event()
        self._next_id = 0

    async def read(self) -> None:
        assert self.process.stdout is not None
        buffer = b""
        async for data in self.process.stdout:
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                message = json.loads(line)
                if "event" in message:
                    self.events.append(message)
                else:
                    self._replies[message["id"]] = message
            self._arrived.set()
            self._arrived = trio.Event()

    async def request(self, op: str, timeout: float = REQUEST_TIMEOUT, **fields: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self._next_id += 1
        number = self._next_id
        await self.process.stdin.send_all(json.dumps({"id": number, "op": op, **fields}).encode() + b"\n")
        with trio.fail_after(timeout):
            while number not in self._replies:
                await self._arrived.wait()
        reply = self._replies.pop(number)
        if not reply["ok"]:
            raise AgentError(reply["error"])
        return reply

    async def join(self, client: str, token: str, **fields: Any) -> dict[str, Any]:
        return await self.request("join", client=client, url=self.livekit.config.url, token=token, **fields)

    async def room_participants(self, room: str) -> list[str]:
        config = self.livekit.config
        reply = await self.request("participants", url=config.url, key=config.api_key, secret=config.api_secret, room=room)
        return reply["identities"]

    async def wait_frames(self, client: str, at_least: int, timeout: float = 20.0) -> int:
        """Wait until ``client`` has decoded ``at_least`` video frames; returns the count."""
        with trio.move_on_after(timeout):
            while (count := (await self.request("frames", client=client))["frames"]) < at_least:
                await trio.sleep(0.2)  # bench-cost: frames come over a real network from another process
            return count
        raise AssertionError(f"{client} decoded {count} frames in {timeout:g} s, not {at_least}")

    async def remove_participant(self, room: str, identity: str) -> None:
        config = self.livekit.config
        await self.request("remove", url=config.url, key=config.api_key, secret=config.api_secret, room=room, identity=identity)

    def messages(self, client: str, topic: str = "tf.status") -> list[dict[str, Any]]:
        """The JSON messages ``client`` received on ``topic`` so far."""
        return [json.loads(e["payload"]) for e in self.events if e["event"] == "data" and e["client"] == client and e["topic"] == topic]

    async def wait_for(self, predicate: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
        """Wait until ``predicate()`` is truthy (re-checked at each line the agent writes); returns its value."""
        with trio.move_on_after(timeout):
            while not (value := predicate()):
                await self._arrived.wait()
            return value
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")

    async def wait_message(self, client: str, kind: str, timeout: float = 20.0, topic: str = "tf.status", **match: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            for message in self.messages(client, topic):
                if message.get("type") == kind and all(message.get(k) == v or message.get("data", {}).get(k) == v for k, v in match.items()):
                    return message
            return None

        return await self.wait_for(found, f"{client}: a {kind!r} message {match or ''} on {topic}", timeout)


@pytest.fixture
async def agent(livekit_server: LiveKit, artifacts: Path) -> AsyncIterator[Agent]:
    with open(artifacts / "agent.stderr.log", "ab") as stderr:
        process = await trio.lowlevel.open_process(
            [*livekit_server.network.prefix(), sys.executable, "-m", "spec_tests.livekit.agent"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, cwd=ROOT,
        )
    driver = Agent(process, livekit_server)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver.read)
            try:
                yield driver
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(10):
                    try:
                        await driver.request("quit", timeout=8)
                    except (AgentError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
            await process.wait()
