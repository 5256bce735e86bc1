"""How a real agent ends when it is cut off from its authority: a stop signal while it dials again exits 128 + the
signal, as in every other phase a signal ends before a drain ran its course (``states.agent.exit_status``); a
frozen authority (SIGSTOP) is one line naming the cause, and a silent dial to it is named a stalled authority.

Before: an agent stopped while it redialed exited 0, which a supervisor reads as "finished as asked" (one stopped
before it first served exited 143). A frozen authority's fence was logged twice (the fence, then the backoff
naming it again), and the next dial, connected but unanswered, said the address was "not a chunkline authority (is
this the --cluster-port?)": after 60 s of that the agent gave up with exit 3, which no launcher replaces.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
import trio

from server.cluster import wire

from .conftest import INTERVAL, TINY, TOKEN, Controller, Process, chunkline, clean_env, start_authority, until
from .test_agent_start_signals import HeldAuthority, exit_code, logged
from .test_hostile_authority import AGENT_ENDED, START_DEADLINE, serve, welcome

#: the line of an agent that dials again after a fence ended its registration, not counted (it counted, as a crash)
FENCE_WAITED = "the authority fenced this worker"
#: the line of an agent that dials again, uncounted, after its authority closed the registration with no word
GONE = "the authority went away without a word"
STALLED = "the authority this agent registered with has stalled"
#: seconds from a frozen authority to the agent's line about its silent dial: the fence (half the deadline), the
#: backoff, and the dial's own 10 s wait for a hello (agent_handshake.CONNECT_TIMEOUT), with a margin
SILENT_DIAL_BOUND = 40.0


class CuttingAuthority:
    """Welcomes the agent's first dial, then closes the connection once ``cut`` is set; closes every later dial
    before its hello (as an authority turning connections away does), so the agent keeps dialing."""

    def __init__(self) -> None:
        self.dials = 0
        self.registered = trio.Event()
        self.cut = trio.Event()

    async def answer(self, stream: trio.SocketStream) -> None:
        self.dials += 1
        channel = wire.Channel(stream)
        try:
            if self.dials == 1:
                await welcome(channel, TOKEN)
                self.registered.set()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._acknowledge, channel)
                    await self.cut.wait()
                    nursery.cancel_scope.cancel()
        except AGENT_ENDED:
            pass
        finally:
            await channel.aclose()


    @staticmethod
    async def _acknowledge(channel: wire.Channel) -> None:
        while True:
            message = await channel.receive()
            if isinstance(message, wire.Heartbeat):
                await channel.send(wire.HeartbeatAck(message.seq))


async def test_an_agent_stopped_while_it_dials_again_exits_128_plus_the_signal() -> None:
    authority = CuttingAuthority()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, authority.answer)
        agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{port}"),
                        clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
        try:
            with trio.fail_after(START_DEADLINE):
                await authority.registered.wait()
            authority.cut.set()
            await logged(agent, GONE, 30)  # registered no more: it dials again
            agent.popen.send_signal(signal.SIGTERM)
            code = await exit_code(agent)
        finally:
            agent.stop()
            nursery.cancel_scope.cancel()
    log = agent.text(200_000)
    assert code == 128 + signal.SIGTERM, log
    assert "while cut off from the authority" in log and "Traceback" not in log, log


async def test_a_frozen_authority_is_one_line_naming_the_fence_and_its_silent_dial_a_stalled_authority() -> None:
    authority = await trio.to_thread.run_sync(lambda: start_authority(launcher="external", workers=1))
    agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{authority.cluster_port}"),
                    clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
    frozen = False
    try:
        await logged(agent, "registered as", START_DEADLINE)
        await trio.sleep(4 * INTERVAL)  # bench-cost: a few heartbeats acknowledged, real time
        os.kill(authority.process.popen.pid, signal.SIGSTOP)
        frozen = True
        await logged(agent, STALLED, SILENT_DIAL_BOUND)
        agent.popen.send_signal(signal.SIGTERM)  # cut off, dialing again: it leaves without registering
        code = await exit_code(agent)
    finally:
        if frozen:
            os.kill(authority.process.popen.pid, signal.SIGCONT)
        agent.stop()
        await trio.to_thread.run_sync(authority.stop)
    log = agent.text(200_000)
    assert code == 128 + signal.SIGTERM, log
    fence = "no heartbeat acknowledged: fenced before the authority's deadline"
    assert log.count(fence) == 1 and log.count(FENCE_WAITED) == 1, log
    assert "authority connection ended" not in log, log  # the counted restart's line: a fence is no crash
    assert "not as a chunkline authority" not in log and "Traceback" not in log, log


async def test_an_agent_drained_through_the_api_says_so_in_its_log_and_how_it_ended() -> None:
    """One line as the drain begins (who asked, the deadline), one as the agent leaves (sessions finished and
    stopped, the exit status): its log ended at "registered as ..." and it exited 0 without a word."""
    authority = await trio.to_thread.run_sync(lambda: start_authority(launcher="external", workers=1))
    agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{authority.cluster_port}"),
                    clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
    try:
        await logged(agent, "registered as", START_DEADLINE)
        await until(lambda: authority.eligible(), "the agent to be ready", authority)
        async with httpx.AsyncClient(base_url=authority.base_url, timeout=10) as client:
            streaming = await Controller.open(client, authority, "alice")
            await streaming.stream(2)  # the session outlives the drain's deadline: it is stopped there
            worker_id = (await client.get(f"/v1/stream/sessions/{streaming.session_id}")).json()["worker_id"]
            drained = await client.post(f"/v1/service/workers/{worker_id}/drain", json={"deadline_seconds": 1.0})
            assert drained.status_code == 202, drained.text
            code = await exit_code(agent)
            await streaming.ws.aclose()
    finally:
        agent.stop()
        await trio.to_thread.run_sync(authority.stop)
    log = agent.text(200_000)
    assert code == 0, log
    asked = f"the authority (POST /v1/service/workers/{worker_id}/drain)"
    assert f"draining, asked by {asked}: no new sessions; 1 live session(s) have 1 s to finish" in log, log
    assert f"drained (asked by {asked}): 0 session(s) finished, 1 stopped; exiting with status 0" in log, log
    assert "Traceback" not in log, log


def test_one_rule_gives_every_way_out_its_exit_status() -> None:
    """0 only once a drain ran its course (or for the authority's own drain, with no signal); 128 + the first signal
    in every other way a signal led the agent out."""
    from states.agent import LEAVING, State, exit_status

    assert exit_status(State.DRAINED, signal.SIGTERM) == 0
    assert exit_status(State.DRAINING, None) == 0
    assert exit_status(State.FAILED, None) == exit_status(State.FAILED, signal.SIGTERM) == 1  # its worker failed
    for state in LEAVING - {State.DRAINED, State.FAILED}:
        assert exit_status(state, signal.SIGINT) == 128 + signal.SIGINT, state


def service_child(agent_pid: int) -> int:
    """The pid of an agent's service process (``--worker-mode process``: a multiprocessing spawn child)."""
    # each thread's own children: the service is started from a worker thread
    children = [pid for task in Path(f"/proc/{agent_pid}/task").iterdir()
                for pid in (task / "children").read_text().split()]
    return next(int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes())


async def test_an_agent_whose_model_worker_fails_once_serving_tells_the_authority_and_exits_1() -> None:
    """Its service process killed: the session on it fails with the runner's words, the agent tells the authority
    (lost at once, its word as the cause) and exits 1 for its supervisor to start another. It stayed registered and
    idle with its full capacity; the next create was placed on it, and that Start ended the agent with a traceback
    (the session hung "assigned" until the heartbeat deadline)."""
    authority = await trio.to_thread.run_sync(lambda: start_authority(launcher="external", workers=1))
    agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{authority.cluster_port}",
                              "--worker-mode", "process", "--node", "failing"),
                    clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
    try:
        [worker] = await until(lambda: authority.eligible(), "the agent to be ready", authority)
        async with httpx.AsyncClient(base_url=authority.base_url, timeout=10) as client:
            streaming = await Controller.open(client, authority, "alice")
            await streaming.stream(2)
            os.kill(service_child(agent.popen.pid), signal.SIGKILL)
            code = await exit_code(agent)
            record = (await client.get(f"/v1/stream/sessions/{streaming.session_id}")).json()
            assert record["status"] == "failed" and "service process" in record["error"], record  # the runner's words
            losses = (await client.get("/v1/service/metadata")).json()["cluster"]["recent_losses"]
            assert [loss["worker_id"] for loss in losses] == [worker["worker_id"]], losses
            assert losses[0]["cause"].startswith("the agent said it failed: its model worker failed: "), losses
            refused = await client.post("/v1/stream/sessions", json={"identity": "bob"})
            assert refused.status_code == 503, refused.text  # no worker: nothing placed on a dead agent
            await streaming.ws.aclose()
    finally:
        agent.stop()
        await trio.to_thread.run_sync(authority.stop)
    log = agent.text(200_000)
    assert code == 1, log
    assert "this agent leaves (exit 1)" in log and "ExceptionGroup" not in log, log


#: ``chunkline worker`` started with SIGHUP ignored, as ``nohup`` starts a command
NOHUP = ["import signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
         "from server.cli import main; sys.exit(main())"]


@pytest.mark.parametrize("nohup", [False, True], ids=["SIGHUP", "SIGHUP under nohup, then SIGTERM"])
async def test_sighup_drains_a_serving_agent_as_sigterm_does_unless_it_was_ignored_as_the_agent_started(
        nohup: bool) -> None:
    """SIGHUP (the agent's terminal closed) is a stop signal, as under ``chunkline stream-serve`` and ``chunkline run``:
    a serving agent drains, says goodbye and exits 0 (its drain ran its course: ``states.agent.exit_status``; one that
    does not exits 129). Before, its default action ended the agent at once: no drain, no goodbye, killed by SIGHUP.
    Ignored as the agent started (``nohup``), it stays ignored."""
    authority = HeldAuthority(hold=None)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, authority.answer)
        command = chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{port}")
        if nohup:
            command[2:3] = NOHUP
        agent = Process(command, clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
        try:
            with trio.fail_after(START_DEADLINE):
                while "ready" not in authority.said():
                    assert agent.popen.poll() is None, agent.text()
                    await trio.sleep(0.05)  # bench-cost: real-time poll of the agent's start, bounded
            agent.popen.send_signal(signal.SIGHUP)
            if nohup:  # an ignored SIGHUP is discarded; one that was not would end the agent (-1) or drain it first
                agent.popen.send_signal(signal.SIGTERM)
            code = await exit_code(agent)
        finally:
            agent.stop()
            nursery.cancel_scope.cancel()
    log = agent.text(200_000)
    assert code == 0, log
    said = authority.said()
    assert said.index("ready") < said.index("drain") < said.index("goodbye"), (said, log)
    assert ("SIGHUP" in log) is not nohup and "Traceback" not in log, log
