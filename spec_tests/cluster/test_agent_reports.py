"""What a token holder reports over the cluster port, against a real ``--workers external`` authority: every field
the authority keeps, shows or logs is bounded to what a real agent would send itself -- cut to one public line
(``server.reasons``), or refused as a protocol error naming the field when it is a count or a size no agent
reaches -- and the authority keeps serving. And a real agent told a long proven refusal logs it cut.

The peers here speak the wire themselves (``server.cluster.wire``), as a hostile or buggy agent would.
"""

from __future__ import annotations


import json
import subprocess
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from server.cluster import proofs, wire
from server.cluster.authority import HANDSHAKE_TIMEOUT, MIN_REGISTERED
from server.cluster.dial_ends import MAX_PROVEN_REASON
from server.cluster.identity import chunkline_version, pipeline_digest, pipeline_name
from server.cluster.remote import STOP_DEADLINE
from server.cluster.rooms import RemoteRooms
from server.cluster.wire_values import (
    MAX_DEVICES, MAX_DRAIN_SECONDS, MAX_LABEL, MAX_NODE, MAX_PARTICIPANTS, MAX_REPORT_CHARS,
)
from server.reasons import MAX_REASON
from server import runner
from server.tokens import MAX_IDENTITY_LENGTH

from .conftest import INTERVAL, ROOT, TINY, TOKEN, Cluster, Process, chunkline, clean_env, until
from .wire_peer import PLAN, closed_by_peer, dial, losses, register, say_ready

#: more than any field a real agent sends; two of them less than an agent's frame (wire.MAX_AGENT_FRAME_BYTES)
HUGE = 256 * 1024
#: a cut field, a refusal or a loss cause that names a field: well under this
SHORT = 1024
#: what a log or a view would hold had it repeated any field whole
REPEATED = "x" * 300


@pytest.fixture(scope="module")
def authority(external_authority: Cluster) -> Cluster:
    return external_authority


class FakeAgent:
    """A registered, ready token holder that heartbeats as a live agent does while the test speaks for it."""

    def __init__(self, channel: wire.Channel) -> None:
        self.channel = channel
        self.stopped = trio.Event()

    async def heartbeat(self) -> None:
        """Until ``stopped`` (never cancelled mid-frame: the channel stays whole for the goodbye)."""
        seq = 0
        while not self.stopped.is_set():
            seq += 1
            try:
                await self.channel.send(wire.Heartbeat(seq, ()))
            except wire.ConnectionClosed:
                return
            with trio.move_on_after(INTERVAL / 2):  # as often as a live agent heartbeats
                await self.stopped.wait()

    async def expect(self, kind: type[wire.Message]) -> Any:
        """The next message of ``kind`` from the authority (acknowledgements skipped)."""
        with trio.fail_after(30):  # a loaded host: the authority reads and answers megabytes before it
            while not isinstance(message := await self.channel.receive(), kind):
                pass
        return message

    async def send_raw(self, body: dict[str, Any]) -> None:
        """A message as JSON: this side's own classes refuse to build one out of bounds."""
        await self.channel.send_body(json.dumps({"v": wire.PROTOCOL, **body}).encode())

    async def create(
        self, client: httpx.AsyncClient, config: dict[str, Any] | None = None, **answer: Any
    ) -> httpx.Response:
        """POST a session (with ``config``, its options); the authority asks this agent to check its options first:
        answered with ``answer``'s fields (none: accepted)."""
        created: list[httpx.Response] = []
        async with trio.open_nursery() as nursery:

            async def post() -> None:
                body = {"identity": "alice"} if config is None else {"identity": "alice", "config": config}
                created.append(await client.post("/v1/stream/sessions", json=body))

            nursery.start_soon(post)
            check = await self.expect(wire.CheckOptions)
            await self.channel.send(wire.OptionsChecked(check.check_id, **answer))
        return created[0]

    async def start_session(self, client: httpx.AsyncClient) -> wire.Start:
        """A session the test creates over HTTP, placed on this agent: its Start."""
        created = await self.create(client)
        assert created.status_code == 200, created.text
        start = await self.expect(wire.Start)
        assert start.session_id == created.json()["session_id"], start
        return start


@asynccontextmanager
async def ready_agent(authority: Cluster, worker_id: str) -> AsyncIterator[FakeAgent]:
    """A token holder, registered and ready; it leaves as a drained agent does (unless it was lost meanwhile)."""
    channel, reply = await register(authority, worker_id)
    assert isinstance(reply, wire.Welcome), reply
    await say_ready(authority, channel, worker_id)
    agent = FakeAgent(channel)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(agent.heartbeat)
        try:
            yield agent
        finally:
            agent.stopped.set()
    if worker_id not in losses(authority):
        try:
            await channel.send(wire.Drain(1.0))
            await channel.send(wire.Goodbye("drained"))
        except wire.ConnectionClosed:
            pass
    await channel.aclose()


def session(authority: Cluster, session_id: str) -> dict[str, Any]:
    return authority.get(f"/v1/stream/sessions/{session_id}")


def listed(authority: Cluster, session_id: str) -> dict[str, Any]:
    return next(s for s in authority.get("/v1/stream/sessions")["sessions"] if s["session_id"] == session_id)


def nothing_repeated_whole(authority: Cluster) -> None:
    """No view and no log line of the authority holds a field whole."""
    for path in ("/v1/stream/sessions", "/v1/stream/health", "/v1/service/metadata", "/metrics"):
        text = authority.http.get(path).text
        assert REPEATED not in text, (path, len(text))
    assert REPEATED not in authority.process.text(1_000_000)


@pytest.mark.parametrize("drain_cause", [None, "controller_left"], ids=["failed", "drained first"])
async def test_a_megabytes_long_finish_error_is_kept_as_one_public_line(authority: Cluster,
                                                                        drain_cause: str | None) -> None:
    """A SessionFinished's error is the session's error (and, with a drain cause, its drain's detail): kept with
    its record for the retention time and shown to whoever holds the id. It was kept whole, 4 MiB per session."""
    worker_id = f"long-finish-{drain_cause or 'failed'}"
    error = "RuntimeError: the pipeline broke: " + "x" * HUGE + "\nTraceback (most recent call last):\n  ..."
    async with httpx.AsyncClient(base_url=authority.base_url, timeout=30) as client, \
            ready_agent(authority, worker_id) as agent:
        start = await agent.start_session(client)
        await agent.channel.send(wire.SessionFinished(start.session_id, 1, error, drain_cause))
        record = await until(lambda: (found := session(authority, start.session_id))["status"] == "failed" and found,
                             "the session to fail", authority, deadline=30)
        assert record["error"].startswith("RuntimeError: the pipeline broke: xxx"), record["error"][:100]
        assert len(record["error"]) <= MAX_REASON, len(record["error"])
        # a failure reported with no cause is its worker's (the record read null: no word on why it ended)
        assert record["drain_cause"] == (drain_cause or "worker_failed"), record["drain_cause"]
        assert listed(authority, start.session_id)["error"] == record["error"]
        nothing_repeated_whole(authority)
        # the authority keeps serving, this agent too: the next session is placed on it, and ends well
        start = await agent.start_session(client)
        await agent.channel.send(wire.SessionFinished(start.session_id, 1, None, None))
        await until(lambda: session(authority, start.session_id)["status"] == "closed", "the next session to close",
                    authority, deadline=30)
    assert worker_id not in losses(authority)


async def test_what_a_session_event_reports_is_kept_bounded(authority: Cluster) -> None:
    """A SessionEvent's pipeline session id is shown with the session, cut; its error is not kept (the finish
    carries the session's error); its participants are at most what a room holds (below), and on the local rooms
    not taken at all (the authority reads its own room)."""
    async with httpx.AsyncClient(base_url=authority.base_url, timeout=30) as client, \
            ready_agent(authority, "long-event") as agent:
        start = await agent.start_session(client)
        await agent.channel.send(wire.SessionEvent(start.session_id, 1, "join_room", error="x" * HUGE,
                                                   pipeline_session_id="p" + "x" * HUGE, participants=("alice",)))
        record = await until(lambda: (found := session(authority, start.session_id))["status"] == "joining_room"
                             and found, "the session to join its room", authority, deadline=30)
        assert record["pipeline_session_id"].startswith("pxxx"), record["pipeline_session_id"][:100]
        assert len(record["pipeline_session_id"]) < MAX_IDENTITY_LENGTH + 40, len(record["pipeline_session_id"])
        # the local rooms are the authority's own: who is there is read from the room (nobody came), not the agent's word
        assert record["participant_count"] == 0, record
        await agent.channel.send(wire.Heartbeat(10**6, ("x" * HUGE,)))  # the sessions it names are not kept
        await agent.expect(wire.HeartbeatAck)
        nothing_repeated_whole(authority)
        await agent.channel.send(wire.SessionFinished(start.session_id, 2, None, None))
        await until(lambda: session(authority, start.session_id)["status"] == "closed", "the session to close",
                    authority, deadline=30)
    assert "long-event" not in losses(authority)


async def test_an_agent_that_could_not_check_options_is_answered_and_logged_cut(authority: Cluster) -> None:
    """OptionsChecked's error (the agent could not check) is the create's 503 and a log line: both cut."""
    async with httpx.AsyncClient(base_url=authority.base_url, timeout=30) as client, \
            ready_agent(authority, "long-check-error") as agent:
        # with options: a create without them is taken unchecked when its check fails
        created = await agent.create(client, {"k": 1}, error="ValueError: " + "x" * HUGE)
        assert created.status_code == 503, created.text[:300]
        assert "xxx" in created.json()["detail"] and len(created.text) < SHORT, created.text[:300]
        await until(lambda: "could not check a session's options" in authority.process.text(1_000_000),
                    "the log line", authority, deadline=30)
        nothing_repeated_whole(authority)
    assert "long-check-error" not in losses(authority)


async def test_an_agent_s_answer_to_an_option_check_is_told_as_the_agent_s_and_prefixed_once(authority: Cluster) -> None:
    """A token holder's refusal is the create's 400 naming the agent whose words it is (it read as this server's
    pipeline's own), and a reason that already says ``config:`` is not prefixed again (it read ``config: config:
    ...``); the same for its error, the create's 503."""
    async with httpx.AsyncClient(base_url=authority.base_url, timeout=30) as client, \
            ready_agent(authority, "says-config") as agent:
        created = await agent.create(client, refused="config: Config: option 'k' is not one this world takes")
        assert created.status_code == 400 and created.json()["error"] == "invalid_option", created.text
        assert created.json()["detail"] == "config: worker 'says-config' refused them: option 'k' is not one this " \
                                           "world takes", created.text
        created = await agent.create(client, {"k": 1},
                                     error="the session's options could not be checked: the model is busy")
        assert created.status_code == 503, created.text
        assert created.json()["detail"] == "the session's options could not be checked: worker 'says-config': the " \
                                           "model is busy", created.text
    assert "says-config" not in losses(authority)


def transport_connected(authority: Cluster) -> tuple[bool, bool]:
    health = authority.get("/v1/stream/health")
    return health["transport_connected"], health["livekit_connected"]


async def test_health_counts_an_agent_in_its_room_only_when_it_is_there(authority: Cluster) -> None:
    """``transport_connected`` (and ``livekit_connected``) said true for a session whose agent never joined its room:
    a mute agent's session draining after its DELETE, and an agent that says it joined and runs without joining.
    An agent that joins the room (the local rooms are the authority's own) is counted, until its session ends."""
    async with httpx.AsyncClient(base_url=authority.base_url, timeout=30) as client, \
            ready_agent(authority, "never-joins") as agent, trio.open_nursery() as nursery:
        start = await agent.start_session(client)
        nursery.start_soon(client.delete, f"/v1/stream/sessions/{start.session_id}")  # answered once it ends
        await agent.expect(wire.Stop)  # the agent says nothing: its session drains until the stop deadline
        assert session(authority, start.session_id)["status"] == "draining"
        assert transport_connected(authority) == (False, False)
        await agent.channel.send(wire.SessionFinished(start.session_id, 1, None, "deleted"))

        start = await agent.start_session(client)
        for seq, event in enumerate(("join_room", "start_pipeline", "run"), 1):  # no join behind the words
            await agent.channel.send(wire.SessionEvent(start.session_id, seq, event))
        await until(lambda: session(authority, start.session_id)["status"] == "running", "the session to run",
                    authority, deadline=30)
        assert transport_connected(authority) == (False, False)
        room = await RemoteRooms(authority.base_url).connect(start.room, start.identity, start.token, timeout=30)
        try:
            assert transport_connected(authority) == (True, True)  # now it is there
        finally:
            await room.disconnect()
        await until(lambda: transport_connected(authority) == (False, False), "its leaving to be counted", authority,
                    deadline=30)
        await agent.channel.send(wire.SessionFinished(start.session_id, 4, None, None))
        await until(lambda: session(authority, start.session_id)["status"] == "closed", "the session to close",
                    authority, deadline=30)
        assert transport_connected(authority) == (False, False)
    assert "never-joins" not in losses(authority)


def test_the_stop_deadline_outlasts_every_bound_an_honest_runner_may_wait_out_after_a_stop() -> None:
    """An agent is lost (and every session it hosts fails) when it has not finished a stopped session within
    ``STOP_DEADLINE``. A stop does not cut a pipeline's session creation short, so an honest agent's runner may wait
    out joining its room, the creation, closing the pipeline session, a failing worker's cause and leaving the
    room, one after another: the deadline was 90 s, under those bounds' 115 s."""
    honest_worst = (runner.CONNECT_TIMEOUT + max(runner.CREATE_PIPELINE_TIMEOUT, runner.CONTROL_TIMEOUT)
                    + runner.CLOSE_PIPELINE_TIMEOUT + runner.WORKER_CAUSE_WAIT + runner.DISCONNECT_TIMEOUT)
    assert STOP_DEADLINE > honest_worst


def _participants(count: int, length: int) -> list[str]:
    return [f"p{index}-".ljust(length, "x") for index in range(count)]


#: after a ready: (message type, field, the message as JSON) that no real agent sends
OUT_OF_BOUNDS: dict[str, tuple[str, dict[str, Any]]] = {
    "participants-count": ("session_event.participants", {
        "type": "session_event", "session_id": "s", "seq": 1, "event": "join_room",
        "participants": _participants(MAX_PARTICIPANTS + 1, 8)}),
    "participant-length": ("session_event.participants[1]", {
        "type": "session_event", "session_id": "s", "seq": 1, "event": "join_room",
        "participants": ["alice", "x" * HUGE]}),
    "ready-kind": ("ready.kind", {"type": "ready", "capacity": 1, "kind": "x" * HUGE, "plan": PLAN}),
    "ready-plan": ("ready.plan", {"type": "ready", "capacity": 1, "kind": "bidirectional",
                                  "plan": {**PLAN, "devices": {"cuda:0": "x" * (MAX_REPORT_CHARS + 1)}}}),
    "ready-startup-check": ("ready.startup_check", {"type": "ready", "capacity": 1, "kind": "bidirectional",
                                                    "plan": PLAN, "startup_check": {"status": "x" * HUGE}}),
    "ready-settings-taken": ("ready.settings_taken", {"type": "ready", "capacity": 1, "kind": "bidirectional",
                                                      "plan": PLAN, "settings_taken": {"x": ["x"] * (HUGE // 8)}}),
    # an hour at most, as a drain through the API and `chunkline worker --drain-deadline`: taken whole, a draining
    # agent that heartbeats was never lost for not saying goodbye
    "drain-deadline": ("drain.deadline", {"type": "drain", "deadline": MAX_DRAIN_SECONDS + 1}),
    "drain-deadline-huge": ("drain.deadline", {"type": "drain", "deadline": 1e300}),
}


@pytest.mark.parametrize("case", list(OUT_OF_BOUNDS))
async def test_a_report_past_what_any_agent_sends_is_a_protocol_error_naming_the_field(authority: Cluster,
                                                                                      case: str) -> None:
    """Participants (at most a room's 64, each at most an identity's 128 characters), a service kind (a name),
    a capacity plan, a startup check and the settings a pipeline took (a few KiB of JSON each), a drain's deadline
    (an hour): past those, the agent is lost with a protocol error naming the field; the authority kept each whole
    (and held a drain open past the deadline plus its grace)."""
    field, body = OUT_OF_BOUNDS[case]
    worker_id = f"oob-{case}"
    channel, reply = await register(authority, worker_id)
    assert isinstance(reply, wire.Welcome), reply
    agent = FakeAgent(channel)
    if body["type"] != "ready":
        await say_ready(authority, channel, worker_id)
    await agent.send_raw(body)
    assert await closed_by_peer(channel.stream, 10.0)  # type: ignore[arg-type]
    await channel.aclose()
    cause = await until(lambda: losses(authority).get(worker_id), f"{worker_id} to be lost", authority, deadline=30)
    assert cause.startswith(f"protocol error: {field}"), cause[:300]
    assert len(cause) < SHORT, len(cause)
    nothing_repeated_whole(authority)
    assert not any(w["worker_id"] == worker_id for w in authority.workers())


#: a register (before any proof: its frame is at most 64 KiB) whose node, launcher, slot, devices or pid no agent
#: sends: (the field, its value)
REGISTER_OUT_OF_BOUNDS: dict[str, tuple[str, Any]] = {
    "node": ("register.node", "x" * (MAX_NODE + 1)),
    "launcher": ("register.launcher", "x" * (MAX_LABEL + 1)),
    "slot": ("register.slot", "x" * 60_000),
    "devices-count": ("register.devices", list(range(MAX_DEVICES + 1))),
    "device-index": ("register.devices[0]", [10**900]),  # the parser takes up to 1,000 digits
    "pid": ("register.pid", 10**900),
}


@pytest.mark.parametrize("case", list(REGISTER_OUT_OF_BOUNDS))
async def test_a_registration_past_what_any_agent_sends_is_refused_naming_the_field(authority: Cluster,
                                                                                    case: str) -> None:
    """What a register says of its agent is shown in health, metadata and recent losses for as long as it lives:
    a node name, a launcher and its slot, device indexes and a pid past any agent's are refused, cut."""
    field, value = REGISTER_OUT_OF_BOUNDS[case]
    worker_id = f"reg-{case}"
    _, channel, hello = await dial(authority)
    body = {"type": "register", "worker_id": worker_id, "agent_nonce": "agent-nonce",
            "proof": proofs.proof_for(TOKEN, hello.nonce, worker_id), "version": chunkline_version(),
            "pipeline": pipeline_name(TINY), "pipeline_digest": pipeline_digest(TINY), "node": "hostile",
            "devices": [], "launcher": "external", "pid": 1, "slot": None}
    body[field.split(".")[1].split("[")[0]] = value
    await FakeAgent(channel).send_raw(body)
    with trio.fail_after(HANDSHAKE_TIMEOUT):
        refused = await channel.receive()
    await channel.aclose()
    assert isinstance(refused, wire.Refused), refused
    assert refused.reason.startswith(field), refused.reason[:300]
    assert len(refused.reason) < SHORT, len(refused.reason)
    assert not any(w["worker_id"] == worker_id for w in authority.workers())
    nothing_repeated_whole(authority)


@pytest.mark.parametrize(("flag", "value"), [
    ("--node", "x" * (MAX_NODE + 1)),
    ("--launcher", "x" * (MAX_LABEL + 1)),
    ("--slot", "x" * (MAX_LABEL + 1)),
    ("--devices", ",".join(str(index) for index in range(MAX_DEVICES + 1))),
])
def test_the_worker_command_refuses_what_its_register_could_not_carry(flag: str, value: str) -> None:
    """The authority would refuse such a register: the command says so before it loads anything."""
    run = subprocess.run(chunkline("worker", TINY, "--authority", "tcp://127.0.0.1:1", flag, value), cwd=str(ROOT),
                         env=clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"chunkline worker: error: {flag}: " in run.stderr and len(run.stderr) < SHORT, run.stderr[-2000:]


@pytest.mark.parametrize(("token", "words"), [
    (None, "no cluster token: set CHUNKLINE_CLUSTER_TOKEN or give --cluster-token-file"),
    ("short", "must be at least 16 bytes"),
    ("file", "CHUNKLINE_CLUSTER_TOKEN_FILE is the server's: give its file as --cluster-token-file"),
])
def test_the_worker_command_says_whether_its_token_is_missing_or_too_short(token: str | None, words: str) -> None:
    """With no token at all it said the token must be at least 16 bytes, as if one had been given; with the
    authority's environment copied (its token file named in ``CHUNKLINE_CLUSTER_TOKEN_FILE``, which the worker does not
    read), only that no token was set."""
    if token == "file":
        env = clean_env(CHUNKLINE_CLUSTER_TOKEN_FILE="/run/secrets/chunkline-token")
    else:
        env = clean_env() if token is None else clean_env(CHUNKLINE_CLUSTER_TOKEN=token)
    run = subprocess.run(chunkline("worker", TINY, "--authority", "tcp://127.0.0.1:1"), cwd=str(ROOT), env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and words in run.stderr and len(run.stderr) < SHORT, run.stderr[-2000:]


async def serve(handler: Any, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``handler`` on a fresh loopback port (started with the port)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handler, listeners)


async def test_an_agent_logs_a_long_proven_refusal_cut(tmp_path: Path) -> None:
    """A real agent that an authority (proving the token) refuses, for now and then for good, with a reason as long
    as a frame before the proofs allows: it waits, then exits 3, and logs each reason cut. It logged them whole."""
    reason = "refused: " + "x" * 60_000
    answered: list[bool] = []

    async def refuse(stream: trio.SocketStream) -> None:
        channel = wire.Channel(stream)
        async with stream:
            await channel.send(wire.Hello("n0nce", "any"))
            register_message = await channel.receive()
            assert isinstance(register_message, wire.Register)
            transient = not answered  # the first dial is refused for now, the next for good
            answered.append(transient)
            proof = proofs.refusal_proof(TOKEN, "n0nce", register_message.agent_nonce, register_message.worker_id,
                                         reason, transient)
            await channel.send(wire.Refused(reason, proof, transient))

    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, refuse)
        agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{port}"),
                        clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN, TMPDIR=str(tmp_path)))
        try:
            rc = await trio.to_thread.run_sync(agent.popen.wait, 240)
        finally:
            agent.stop()
        nursery.cancel_scope.cancel()
    log = agent.text(1_000_000)
    assert rc == 3, log[-3000:]
    assert answered == [True, False], answered
    assert "refused this worker for now (refused: xxx" in log, log[-3000:]
    assert "the authority refused this worker: refused: xxx" in log, log[-3000:]
    assert "x" * (MAX_PROVEN_REASON + 1) not in log, len(log)
    assert "(60009 characters in all)" in log, log[-3000:]


async def test_a_token_holder_cannot_make_the_authority_hold_workers_without_end(authority: Cluster) -> None:
    """Any number of registrations were taken, each a record, a connection and up to a frame's buffer the authority
    held. Past its limit (4 per expected worker, at least 16) a registration is refused for now, the agent told why
    (transient: a real agent dials again), and taken again once a worker has left."""
    limit = authority.get("/v1/service/metadata")["cluster"]["workers_limit"]
    assert limit == MIN_REGISTERED  # 4 x the one expected worker is less
    async with AsyncExitStack() as held:
        for index in range(limit):
            await held.enter_async_context(ready_agent(authority, f"many-{index}"))
        channel, reply = await register(authority, "one-too-many")
        await channel.aclose()
        assert isinstance(reply, wire.Refused) and reply.transient, reply
        assert f"the authority holds {limit} workers, its limit" in reply.reason, reply
    async with ready_agent(authority, "after-they-left"):  # every one of them left: taken again
        pass
