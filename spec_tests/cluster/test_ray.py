"""``--workers ray`` on a real Ray cluster (``-m ray``): one module-scoped ``ray.cluster_utils.Cluster`` —
a head with no CPUs for work and two nodes with two logical GPUs each — and one authority placing a
two-GPU agent per node. Sessions spread over both nodes; a removed node fails its sessions with the
cause while the queue waits for the other; a node that joins gets the replacement; a drained slot gives
its GPUs back; the authority killed leaves no actor and no placement group behind."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray  # the test extra installs chunkline[ray]'s Ray: these tests run, never skip
import trio
from ray import cluster_utils

from server.cluster.launch_ray import PLACEMENT_NOTICE

from .conftest import DEADLINE, Cluster, Controller, start_authority, start_cluster, until, wait_for
from .test_unloadable_agents import broken_pipeline, told_once

pytestmark = pytest.mark.ray

NODE = {"num_cpus": 1, "num_gpus": 2}
LOSS_BOUND = DEADLINE + 20.0  # the socket closes when the node's processes die; Ray's own notice may come later


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        cluster.add_node(**NODE)
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="chunkline-tests", log_to_driver=False, configure_logging=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def authority(ray_cluster: Any) -> Iterator[Cluster]:
    found = start_cluster("--ray-address", ray_cluster.address, "--worker-gpu-map", "0,1;2,3", launcher="ray")
    try:
        yield found
    finally:
        found.http.close()
        found.process.stop()


def node_names(cluster: Any) -> dict[str, Any]:
    """The agents' node names (a Ray node id's first 12 characters) -> the cluster's node handles."""
    return {node.node_id[:12]: node for node in cluster.list_all_nodes() if node is not cluster.head_node}


def eligible_by_node(authority: Cluster) -> dict[str, dict[str, Any]]:
    return {w["node"]: w for w in authority.eligible()}


async def record(client: httpx.AsyncClient, session_id: str) -> dict[str, Any]:
    return (await client.get(f"/v1/stream/sessions/{session_id}")).json()


async def status_is(client: httpx.AsyncClient, session_id: str, *statuses: str) -> dict[str, Any] | None:
    found = await record(client, session_id)
    return found if found["status"] in statuses else None


def gpus_free() -> float:
    return ray.available_resources().get("GPU", 0.0)


async def test_sessions_spread_over_both_nodes(ray_cluster: Any, authority: Cluster) -> None:
    await until(lambda: len(authority.eligible()) == 2, "two ray agents", authority)
    assert set(eligible_by_node(authority)) == set(node_names(ray_cluster))  # one agent per node
    async with httpx.AsyncClient(base_url=authority.base_url, timeout=10) as client:
        a = await Controller.open(client, authority, "alice")
        b = await Controller.open(client, authority, "bob")
        await a.stream(2)
        await b.stream(2)
        workers = {w["worker_id"]: w for w in authority.workers()}
        nodes = {workers[(await record(client, c.session_id))["worker_id"]]["node"] for c in (a, b)}
        assert nodes == set(node_names(ray_cluster))
        for entry in workers.values():
            assert entry["launcher"] == "ray" and len(entry["devices"]) == 2
        metadata = (await client.get("/v1/service/metadata")).json()
        assert metadata["workers_launcher"] == "ray"
        assert all(slot["placed"] and slot["state"] == "running" for slot in metadata["cluster"]["slots"])
        assert gpus_free() == 0.0  # both placement groups hold their node's two GPUs
        for c in (a, b):
            await client.delete(f"/v1/stream/sessions/{c.session_id}")
            await c.ws.aclose()


async def test_a_removed_node_fails_its_sessions_queued_ones_wait_for_the_other_and_a_new_node_gets_the_replacement(
    ray_cluster: Any, authority: Cluster
) -> None:
    await until(lambda: len(authority.eligible()) == 2, "two ray agents", authority)
    async with httpx.AsyncClient(base_url=authority.base_url, timeout=10) as client:
        a = await Controller.open(client, authority, "alice")
        b = await Controller.open(client, authority, "bob")
        waiting = await Controller.open(client, authority, "carol")
        assert waiting.session["status"] == "queued"
        await a.stream(2)
        await b.stream(2)
        workers = {w["worker_id"]: w for w in authority.workers()}
        victim = workers[(await record(client, a.session_id))["worker_id"]]
        other = workers[(await record(client, b.session_id))["worker_id"]]
        removed_at = time.monotonic()
        ray_cluster.remove_node(node_names(ray_cluster)[victim["node"]], allow_graceful=False)
        failed = await until(lambda: status_is(client, a.session_id, "failed"), "the removed node's session to fail",
                             authority, deadline=LOSS_BOUND)
        assert failed["error"].startswith("worker lost: "), failed
        assert time.monotonic() - removed_at < LOSS_BOUND
        assert (await record(client, b.session_id))["status"] == "running"
        assert (await record(client, waiting.session_id))["status"] == "queued"  # waits; not failed with the node
        # the other node frees its slot: the queue head runs there
        await client.delete(f"/v1/stream/sessions/{b.session_id}")
        promoted = await until(lambda: status_is(client, waiting.session_id, "running"), "the queue head to run",
                               authority)
        assert promoted["worker_id"] == other["worker_id"]
        await waiting.stream(2)
        # the lost slot's placement group waits for room; a node joins and the replacement registers there
        assert any(not slot["placed"] for slot in authority.get("/v1/service/metadata")["cluster"]["slots"])
        joined = ray_cluster.add_node(**NODE)
        replacement = await until(lambda: eligible_by_node(authority).get(joined.node_id[:12]),
                                  "the replacement agent on the new node", authority)
        assert replacement["worker_id"] != victim["worker_id"]
        assert any(loss["worker_id"] == victim["worker_id"] for loss in
                   authority.get("/v1/service/metadata")["cluster"]["recent_losses"])
        await client.delete(f"/v1/stream/sessions/{waiting.session_id}")
        for c in (a, b, waiting):
            await c.ws.aclose()


async def test_drain_gives_the_slots_gpus_back_to_ray(authority: Cluster) -> None:
    await until(lambda: len(authority.eligible()) == 2, "two ray agents", authority)
    async with httpx.AsyncClient(base_url=authority.base_url, timeout=10) as client:
        a = await Controller.open(client, authority, "alice")
        await a.stream(2)
        target = (await record(client, a.session_id))["worker_id"]
        response = await client.post(f"/v1/service/workers/{target}/drain", json={"deadline_seconds": 1.0})
        assert response.status_code == 202, response.text
        final = await until(lambda: status_is(client, a.session_id, "closed", "failed"), "the drained session to end",
                            authority, deadline=60)
        assert final["status"] == "closed" and final["error"] is None, final
        await until(lambda: gpus_free() == 2.0, "the drained slot's GPUs back in Ray", authority, deadline=60)
        slots = authority.get("/v1/service/metadata")["cluster"]["slots"]
        assert sorted(slot["state"] for slot in slots) == ["running", "stopped"]
        await a.ws.aclose()


async def test_the_authority_killed_leaves_no_actor_and_no_placement_group(authority: Cluster) -> None:
    pids = [w["pid"] for w in authority.workers()]
    assert pids
    os.kill(authority.process.popen.pid, signal.SIGKILL)
    await trio.to_thread.run_sync(authority.process.popen.wait, 30)
    seen: list[Any] = []

    def all_free() -> bool:
        # the nodes alive now (a removed node leaves the totals once Ray has declared it dead)
        alive = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        total = {kind: sum(r.get(kind, 0.0) for r in alive) for kind in ("GPU", "CPU")}
        free = {kind: ray.available_resources().get(kind, 0.0) for kind in ("GPU", "CPU")}
        seen[:] = [total, free]
        return free == total

    try:
        await until(all_free, "every resource back in Ray", None, deadline=120)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: alive totals and free resources {seen}") from None
    from ray.util import placement_group_table

    assert all(group["state"] == "REMOVED" for group in placement_group_table().values())
    for pid in pids:
        wait_for(lambda pid=pid: not _alive(pid), f"agent pid {pid} to die with its actor", deadline=30)


def _alive(pid: int) -> bool:
    from .conftest import _alive as alive

    return alive(pid)


async def test_a_ray_agent_whose_pipeline_never_loads_is_started_twice_and_told_once(ray_cluster: Any,
                                                                                     tmp_path: Path) -> None:
    """As under --workers local (test_unloadable_agents.py): the agent's load failure comes back through its actor.
    One CPU slot: the module's authority holds the nodes' GPUs only."""
    pipeline = broken_pipeline(tmp_path)
    await told_once(start_authority("--ray-address", ray_cluster.address, launcher="ray", workers=1,
                                    pipeline=str(pipeline), token=None), "ray-0", pipeline,
                    exits_cleanly=False)


async def test_a_slot_no_node_can_place_says_what_it_waits_for(ray_cluster: Any) -> None:
    """A group of three GPUs, on nodes of two: the slot waits for Ray for good (a node may join), and the server was
    unhealthy without a word of its own (only Ray's autoscaler said it could not fulfil the request)."""
    pending = start_authority("--ray-address", ray_cluster.address, "--worker-gpu-map", "0,1,2", launcher="ray",
                              workers=1)
    try:
        line = "ray slot 0: Ray has not placed its agent in 10 s: it needs {'GPU': 3} on one node, which no node has free"
        await until(lambda: line in pending.process.text(), "the slot's notice", pending, deadline=PLACEMENT_NOTICE + 60)
        assert pending.process.text().count(line) == 1, pending.process.text()  # said once, not every look
        (slot,) = pending.get("/v1/service/metadata")["cluster"]["slots"]
        assert slot["placed"] is False and slot["worker_id"] is None, slot
    finally:
        pending.http.close()
        pending.process.stop()


async def test_a_stop_signal_drains_a_ray_authority_without_a_crash_report(ray_cluster: Any) -> None:
    """SIGTERM is chunkline's drain, under --workers ray too: Ray's driver had its own handler print a crash report
    (``*** SIGTERM received at time=...`` and a stack) ahead of the drain, which read as a crash."""
    authority = await trio.to_thread.run_sync(
        lambda: start_cluster("--ray-address", ray_cluster.address, launcher="ray", workers=1))
    await trio.to_thread.run_sync(authority.stop)  # exit 0, or its log says why not
    log = authority.process.text(200_000)
    assert "SIGTERM received" not in log and "***" not in log, log
    assert "shutdown complete" in log, log
