"""Worker agents against a real authority: streaming, kill -9, SIGSTOP, a blackholed connection,
refused registrations, drain through the API and SIGTERM (real processes, real signals)."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from typing import Any

import httpx
import pytest
import trio

from server.cluster.agent import EXIT_REFUSED, Agent, AgentOptions

from .conftest import (DEADLINE, TINY, TOKEN, Cluster, Controller, Process, chunkline, clean_env, free_port,
                       start_authority, unserved_port, until)
from .test_agent_dial_ends import waited_dials

LOSS_BOUND = DEADLINE + 11.0  # a hang bound: heartbeat deadline, sweep and settle, with slack for a loaded host


async def record(client: httpx.AsyncClient, session_id: str) -> dict[str, Any]:
    return (await client.get(f"/v1/stream/sessions/{session_id}")).json()


def by_id(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {w["worker_id"]: w for w in cluster.workers()}


async def ready_fleet(cluster: Cluster, count: int = 2) -> dict[str, dict[str, Any]]:
    """Wait until ``count`` local agents are ready and idle (a previous test may have replaced one)."""
    await until(lambda: len([w for w in cluster.workers() if w["launcher"] == "local" and w["state"] == "idle"])
                >= count, f"{count} idle local agents", cluster)
    return by_id(cluster)


async def test_sessions_run_on_agents_spread_over_workers_and_health_lists_them(cluster: Cluster) -> None:
    await ready_fleet(cluster)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
        a = await Controller.open(client, cluster, "alice")
        b = await Controller.open(client, cluster, "bob")
        await a.stream(4)
        await b.stream(4)
        ra, rb = await record(client, a.session_id), await record(client, b.session_id)
        assert ra["status"] == rb["status"] == "running"
        assert ra["worker_id"] != rb["worker_id"]  # least-loaded: one per agent
        workers = by_id(cluster)
        for r in (ra, rb):
            entry = workers[r["worker_id"]]
            assert entry["state"] == "busy" and entry["retained"] == 1 and entry["capacity"] == 1
            assert entry["launcher"] == "local" and entry["liveness"] == "ready" and entry["pid"] > 0
            assert 0 <= entry["heartbeat_age"] < DEADLINE
        # the controller sees its agent in the room: joined after it, or there when it joined (whichever came first)
        agent = f"chunkline-{ra['worker_id']}"
        assert any(m.get("identity") == agent or agent in m.get("participants", ())
                   for m in a.inbox if isinstance(m, dict) and m.get("type") in ("joined", "participant_joined"))
        metadata = (await client.get("/v1/service/metadata")).json()
        assert metadata["workers_launcher"] == "local"
        assert metadata["cluster"]["workers_expected"] == 2
        assert {s["state"] for s in metadata["cluster"]["slots"]} == {"running"}
        assert metadata["session_capacity"][ra["worker_id"]]["effective_capacity"] == 1
        assert metadata["control_idle_timeout"] is None  # the tiny world's get_service takes **_: not handed it
        text = (await client.get("/metrics")).text
        assert 'chunkline_workers{state="busy"} 2.0' in text
        for c in (a, b):
            assert (await client.delete(f"/v1/stream/sessions/{c.session_id}")).json()["status"] == "closed"
            await c.ws.aclose()


async def test_kill_9_mid_chunk_fails_the_session_with_the_cause_and_the_queue_head_runs_elsewhere(
    cluster: Cluster,
) -> None:
    before = await ready_fleet(cluster)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
        a = await Controller.open(client, cluster, "alice")
        b = await Controller.open(client, cluster, "bob")
        waiting = await Controller.open(client, cluster, "carol")
        assert waiting.session["status"] == "queued" and waiting.session["queue_position"] == 1
        await a.stream(2)
        await b.stream(2)
        victim = (await record(client, a.session_id))["worker_id"]
        killed_at = time.monotonic()
        os.kill(before[victim]["pid"], signal.SIGKILL)
        failed = await until(lambda: _terminal(client, a.session_id), "the victim's session to fail", cluster,
                             deadline=LOSS_BOUND)
        assert failed["status"] == "failed"
        # whichever notice comes first names the cause: the socket closing or the launcher seeing the exit
        assert failed["error"].startswith(("worker lost: connection closed", "worker lost: process exited")), failed
        assert time.monotonic() - killed_at < LOSS_BOUND
        # the slot is released and a replacement agent registers (fresh id); the queue head runs there
        promoted = await until(lambda: _running(client, waiting.session_id), "the queue head to run", cluster)
        assert promoted["worker_id"] not in (victim, (await record(client, b.session_id))["worker_id"])
        await waiting.stream(2)
        assert victim not in by_id(cluster)
        metadata = (await client.get("/v1/service/metadata")).json()
        assert any(loss["worker_id"] == victim for loss in metadata["cluster"]["recent_losses"])
        text = (await client.get("/metrics")).text
        assert any(f'chunkline_worker_losses_total{{cause="{cause}"}}' in text for cause in
                   ("connection_closed", "process_exited")), text
        # the launcher's replacement is a worker restart, as an in-process slot's is (health counted none of them)
        assert re.search(r"^chunkline_worker_restarts_total [1-9]", text, re.M), text
        health = (await client.get("/v1/stream/health")).json()
        assert health["worker_restarts"] >= 1, health
        assert any(slot["restarts"] >= 1 for name, slot in health["worker_slots"].items() if name.startswith("local-")), health
        assert (await record(client, b.session_id))["status"] == "running"  # the other agent never noticed
        for c in (b, waiting):
            await client.delete(f"/v1/stream/sessions/{c.session_id}")
        for c in (a, b, waiting):
            await c.ws.aclose()


async def test_a_frozen_agent_is_lost_at_its_heartbeat_deadline_and_replaced(cluster: Cluster) -> None:
    before = await ready_fleet(cluster)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
        a = await Controller.open(client, cluster, "alice")
        await a.stream(2)
        victim = (await record(client, a.session_id))["worker_id"]
        pid = before[victim]["pid"]
        frozen_at = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            failed = await until(lambda: _terminal(client, a.session_id), "the frozen agent's session to fail",
                                 cluster, deadline=LOSS_BOUND)
            took = time.monotonic() - frozen_at
            assert failed["status"] == "failed" and failed["error"].startswith("worker lost: heartbeat missed")
            assert took < LOSS_BOUND, took  # the cause says it was the deadline, not the socket
            # the launcher gives it a window to register again, then kills it and starts a new agent
            await until(lambda: not _alive(pid), "the frozen agent to be killed", cluster, deadline=60)
        finally:
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
        await ready_fleet(cluster)
        assert victim not in by_id(cluster)
        await a.ws.aclose()


async def test_an_agent_cut_off_by_a_blackholed_relay_fences_itself_before_the_authority_gives_up(
    cluster: Cluster,
) -> None:
    await ready_fleet(cluster)
    relay = Relay(cluster.cluster_port)
    agent_log: Process | None = None
    async with trio.open_nursery() as nursery:
        port = await nursery.start(relay.serve)
        agent_log = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{port}", "--node", "relayed",
                                      "--max-sessions", "1", "--drain-deadline", "5"),
                            clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
        try:
            relayed = await until(lambda: [w for w in cluster.workers() if w["node"] == "relayed" and
                                           w["state"] == "idle"], "the relayed agent to be ready", cluster)
            first_id = relayed[0]["worker_id"]
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
                # fill the two local agents, so the third session lands on the relayed one
                controllers = [await Controller.open(client, cluster, name) for name in ("a", "b", "c")]
                on_relayed = next(c for c in controllers if c.session["worker_id"] == first_id)
                await on_relayed.stream(2)
                relay.blackhole = True
                cut_at = time.monotonic()
                with trio.fail_after(LOSS_BOUND):
                    while not on_relayed.left(f"chunkline-{first_id}"):
                        await on_relayed.next()
                fenced_after = time.monotonic() - cut_at
                failed = await until(lambda: _terminal(client, on_relayed.session_id), "the cut-off session to fail",
                                     cluster, deadline=LOSS_BOUND)
                lost_after = time.monotonic() - cut_at
                # the agent stopped its session (left the room) before the authority's deadline made it lost
                assert fenced_after < lost_after < LOSS_BOUND, (fenced_after, lost_after)
                assert failed["error"].startswith("worker lost: heartbeat missed"), failed["error"]
                relay.blackhole = False
                again = await until(lambda: [w for w in cluster.workers() if w["node"] == "relayed"
                                             and w["worker_id"] != first_id], "the agent to register again", cluster)
                assert again[0]["launcher"] == "external"
                summary = (await client.get("/v1/service/metadata")).json()["cluster"]
                assert summary["stale_messages_dropped"] >= 0
                for c in controllers:
                    await client.delete(f"/v1/stream/sessions/{c.session_id}")
                    await c.ws.aclose()
        finally:
            assert agent_log.stop(20) == 0, agent_log.text()
            nursery.cancel_scope.cancel()


async def test_registrations_with_another_pipeline_version_or_token_are_refused(cluster: Cluster) -> None:
    authority = f"tcp://127.0.0.1:{cluster.cluster_port}"
    other = Process(chunkline("worker", "pipelines/replay", "--authority", authority, "--max-sessions", "1"),
                    clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
    wrong = Process(chunkline("worker", TINY, "--authority", authority),
                    clean_env(CHUNKLINE_CLUSTER_TOKEN="not-the-cluster-token"))
    for process in (other, wrong):
        await trio.to_thread.run_sync(process.popen.wait, 240)
        process.stop()
    assert other.popen.returncode == EXIT_REFUSED, other.text()
    assert "pipeline 'replay' differs from the authority's 'tiny_world'" in other.text()
    assert wrong.popen.returncode == EXIT_REFUSED and "the cluster token does not match" in wrong.text()
    # paced as waited dials are: the first refusal and restart at once, then a line with a count every 30 s at most
    # (it was two lines a dial, nine dials, in the ~20 s to its crash loop)
    said = wrong.text(200_000)
    assert said.count("refused this worker without proving the cluster token") == 1, said
    assert len(re.findall(r"restart \d of \d+ within", said)) == 1 and "crash loop: 9 failures" in said, said
    options = AgentOptions(pipeline=TINY, authority=authority, token=TOKEN, version="0.0.1-older")
    with trio.fail_after(120):
        assert await Agent(options).run() == EXIT_REFUSED
    summary = cluster.get("/v1/service/metadata")["cluster"]
    assert summary["registrations_refused"] >= 3
    assert all(w["node"] != "relayed" or w["state"] != "starting" for w in cluster.workers())


async def test_an_agent_naming_the_local_launcher_that_it_did_not_start_is_refused(cluster: Cluster) -> None:
    """An agent of an earlier authority on this host names the same launcher and slot: it is not taken in
    (taken in, it claimed a filled slot, and the loss of the launcher's own agent failed its sessions)."""
    await ready_fleet(cluster)
    before = {w["pid"] for w in cluster.workers()}
    stranger = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{cluster.cluster_port}",
                                 "--launcher", "local", "--slot", "0", "--max-sessions", "1"),
                       clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
    await trio.to_thread.run_sync(stranger.popen.wait, 240)
    stranger.stop()
    assert stranger.popen.returncode == EXIT_REFUSED, stranger.text()
    assert f"pid {stranger.popen.pid} is not the agent this authority started for local slot 0" in stranger.text()
    assert {w["pid"] for w in cluster.workers()} == before
    assert all(slot["state"] != "gave_up" for slot in cluster.get("/v1/service/metadata")["cluster"]["slots"])


async def test_the_agents_of_a_local_authority_killed_with_sigkill_end_with_it() -> None:
    """kill -9 leaves the authority no way to stop its agents: each watches it and exits (they dialed its port
    for minutes holding their models, and joined a restarted authority as extra workers of its slots)."""
    cluster = start_authority(workers=1)
    try:
        (agent,) = await until(lambda: [w for w in cluster.workers() if w["state"] == "idle"], "a ready agent",
                               cluster)
        os.kill(cluster.process.popen.pid, signal.SIGKILL)
        await until(lambda: not _alive(agent["pid"]), "the agent to exit after its authority", cluster,
                    deadline=LOSS_BOUND)
        await until(lambda: "the authority that started this agent" in cluster.process.text(),
                    "the agent's last line", cluster, deadline=LOSS_BOUND)
        assert f"(pid {cluster.process.popen.pid}) is gone; exiting" in cluster.process.text()
    finally:
        cluster.http.close()
        cluster.process.stop()


async def test_drain_through_the_api_finishes_the_live_session_at_a_chunk_boundary_then_the_agent_exits(
    cluster: Cluster,
) -> None:
    workers = await ready_fleet(cluster)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
        a = await Controller.open(client, cluster, "alice")
        await a.stream(2)
        target = (await record(client, a.session_id))["worker_id"]
        pid = workers[target]["pid"]
        bad = await client.post(f"/v1/service/workers/{target}/drain", json={"deadline_seconds": -1})
        assert bad.status_code == 400 and "deadline_seconds" in bad.json()["detail"]
        assert (await client.post("/v1/service/workers/nobody/drain")).status_code == 404
        response = await client.post(f"/v1/service/workers/{target}/drain", json={"deadline_seconds": 1.0})
        assert response.status_code == 202 and response.json()["state"] == "draining"
        # no new session goes to the draining worker
        b = await Controller.open(client, cluster, "bob")
        assert b.session["worker_id"] not in (None, target)
        with trio.fail_after(60):
            while not a.statuses("done"):
                if await a.next() is None:
                    break
        done = a.statuses("done")
        assert done and done[0]["total_chunks"] >= 1, a.inbox[-3:]
        final = await until(lambda: _terminal(client, a.session_id), "the drained session to close", cluster)
        assert final["status"] == "closed" and final["error"] is None
        await until(lambda: not _alive(pid), "the drained agent to exit", cluster, deadline=60)
        assert target not in by_id(cluster)
        await until(lambda: "stopped" in {s["state"] for s in cluster.get("/v1/service/metadata")["cluster"]["slots"]},
                    "its slot to stay down, drained", cluster, deadline=30)
        await client.delete(f"/v1/stream/sessions/{b.session_id}")
        for c in (a, b):
            await c.ws.aclose()


async def test_sigterm_to_an_agent_drains_it(cluster: Cluster) -> None:
    survivors = await until(lambda: [w for w in cluster.workers() if w["launcher"] == "local"
                                     and w["state"] == "idle"], "an idle local agent", cluster)
    target = survivors[0]
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
        a = await Controller.open(client, cluster, "alice")
        assert a.session["worker_id"] == target["worker_id"]
        await a.stream(2)
        os.kill(target["pid"], signal.SIGTERM)
        await until(lambda: by_id(cluster).get(target["worker_id"], {}).get("state") in ("draining", None),
                    "the agent to report its drain", cluster, deadline=20)
        late = await client.post("/v1/stream/sessions", json={"identity": "late"})
        # on the other agent, queued, refused or no worker left (as after the API drain test): never on the drainer
        assert late.status_code in (202, 429, 503) or (
            late.status_code == 200 and late.json()["worker_id"] != target["worker_id"]), late.text
        await client.delete(f"/v1/stream/sessions/{late.json().get('session_id', 'none')}")
        await client.delete(f"/v1/stream/sessions/{a.session_id}")
        await until(lambda: not _alive(target["pid"]), "the agent to exit after SIGTERM", cluster, deadline=60)
        final = await record(client, a.session_id)
        assert final["status"] == "closed", final
        await a.ws.aclose()
    slots = await until(lambda: (found := cluster.get("/v1/service/metadata")["cluster"]["slots"])
                        and any(slot["state"] == "stopped" for slot in found) and found,
                        "its slot to stay down, drained", cluster, deadline=30)
    # unhealthy once no agent is left to admit (after the API drain test drained the other, in module order), else
    # degraded: a slot is down either way, and this test holds whichever way it runs
    health = await until(lambda: (found := cluster.get("/v1/stream/health"))["status"] != "healthy" and found,
                         "health to say a slot is down", cluster, deadline=30)
    assert health["status"] == ("unhealthy" if health["free_slots"] == 0 else "degraded"), (health, slots)


async def test_a_second_sigterm_ends_the_agents_sessions_with_that_reason_and_exits_143(tmp_path) -> None:
    """The first SIGTERM drains; a second one stops the sessions at once. They fail saying so (they failed as
    "worker lost: left after draining") and the agent exits 128 + SIGTERM, not 0 as if it had drained; its log counts
    each session once, as stopped."""
    cluster = start_authority(launcher="external", workers=1)
    agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{cluster.cluster_port}",
                              "--max-sessions", "1"), clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN, TMPDIR=str(tmp_path)))
    try:
        (worker,) = await until(lambda: [w for w in cluster.workers() if w["state"] == "idle"], "a ready agent",
                                cluster)
        assert worker["pid"] == agent.popen.pid
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
            a = await Controller.open(client, cluster, "alice")
            await a.stream(2)
            agent.popen.send_signal(signal.SIGTERM)
            await until(lambda: by_id(cluster).get(worker["worker_id"], {}).get("state") == "draining",
                        "the agent to drain", cluster, deadline=20)
            agent.popen.send_signal(signal.SIGTERM)
            code = await trio.to_thread.run_sync(agent.popen.wait, LOSS_BOUND)
            assert code == 128 + signal.SIGTERM, agent.text()
            final = await until(lambda: _terminal(client, a.session_id), "the session to end", cluster)
            assert final["status"] == "failed", final
            assert final["error"] == "the worker was stopped before its sessions finished (a second SIGTERM)", final
            with trio.fail_after(LOSS_BOUND):
                while not a.statuses("error") and await a.next() is not None:
                    pass
            assert "a second SIGTERM" in str(a.statuses("error")[-1]), a.inbox[-3:]
            await a.ws.aclose()
    finally:
        agent.stop()
        cluster.stop()
    # its session counted once, as stopped (it read "1 session(s) finished, 1 stopped")
    log = agent.text(200_000)
    assert "drain cut short by a second SIGTERM (asked by SIGTERM): 0 session(s) finished, 1 stopped; exiting with " \
           "status 143" in log, log


# -- helpers -----------------------------------------------------------------------------------


async def test_an_agent_killed_before_any_image_leaves_no_folder_behind(tmp_path) -> None:
    """The agent's folder for uploaded images is made with the first one: kill -9 before that leaves nothing."""
    nobody = unserved_port()  # no authority listens: the agent loads its model, then keeps dialing
    agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{nobody}"),
                    clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN, TMPDIR=str(tmp_path)))
    try:
        await until(lambda: f"127.0.0.1:{nobody}" in agent.text(), "the agent to dial the absent authority")
        os.kill(agent.popen.pid, signal.SIGKILL)
        await trio.to_thread.run_sync(agent.popen.wait, DEADLINE)
    finally:
        agent.stop()
    assert agent.popen.returncode == -signal.SIGKILL
    assert not list(tmp_path.glob("chunkline-agent-*")), agent.text()


async def test_an_agent_keeps_dialing_an_authority_that_is_not_up_and_registers_once_it_is(tmp_path) -> None:
    """Dials that reach no authority at all (it restarts: its drain alone may take 55 s) are not a crash loop: an
    external agent, which no launcher replaces, gave up after 8 of them, some 20 s in, and was gone for good."""
    held = socket.socket()  # the port stays taken (dials to it refused) until the authority is started on it
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{port}"),
                    clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN, TMPDIR=str(tmp_path)))
    cluster = None
    try:
        # one line for the first dial, then one with the count every DIAL_LOG_EVERY (it logged each, one a second)
        await until(lambda: waited_dials(agent.text(200_000)) >= 10, "ten dials to an authority that is not up")
        log = agent.text(200_000)
        assert agent.popen.poll() is None, log
        assert "not counted as a crash; the agent gives up after 300 s of such dials" in log, log
        assert log.count("the authority is unreachable") == 2, log
        # the authority must take the port the agent dials (it cannot bind 0 here): it was no other process's while the
        # agent dialed it, and is free only from now, as the authority starts
        held.close()
        cluster = start_authority("--cluster-port", str(port), launcher="external", workers=1)
        await until(lambda: any(w.get("pid") == agent.popen.pid for w in cluster.workers()),
                    "the agent to register", cluster)
        # the authority lists it before its welcome goes out: the agent's line may come a moment later
        await until(lambda: re.search(r"registered as \S+ with \S+ after \d+ dials over \d+ s", agent.text(200_000)),
                    "the agent's line about its registration", cluster, deadline=30)
    finally:
        held.close()
        if cluster is not None:
            cluster.stop()
        agent.stop()


async def _terminal(client: httpx.AsyncClient, session_id: str) -> dict[str, Any] | None:
    found = await record(client, session_id)
    return found if found["status"] in ("closed", "failed", "expired") else None


async def _running(client: httpx.AsyncClient, session_id: str) -> dict[str, Any] | None:
    found = await record(client, session_id)
    return found if found["status"] == "running" else None


def _alive(pid: int) -> bool:
    from .conftest import _alive as alive

    return alive(pid)


class Relay:
    """A TCP relay the test controls: forwards bytes both ways until ``blackhole`` drops them silently
    (the sockets stay open, as a partition looks to both ends)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.blackhole = False

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._pair, listeners)

    async def _pair(self, downstream: trio.SocketStream) -> None:
        async with downstream:
            if self.blackhole:
                await trio.sleep_forever()
            async with await trio.open_tcp_stream("127.0.0.1", self.target_port) as upstream:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pipe, downstream, upstream, nursery.cancel_scope)
                    nursery.start_soon(self._pipe, upstream, downstream, nursery.cancel_scope)

    async def _pipe(self, source: trio.SocketStream, sink: trio.SocketStream, scope: trio.CancelScope) -> None:
        try:
            while data := await source.receive_some(65536):
                if not self.blackhole:
                    await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        if self.blackhole:
            await trio.sleep_forever()  # a partition carries no close either: the far end hears nothing
        scope.cancel()


_ = (pytest, free_port)
