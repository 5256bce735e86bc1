"""Queued sessions that no worker will ever run end at once, with the reason (``server/orphaned_queue.py``).

With ``--workers local`` and the cluster token the authority made itself, no agent can join but the launcher's:
once its last slot stays down (drained through the API), a create is a 503 with no ``Retry-After``, and the sessions
already queued fail as ``worker_drain`` naming the slot. They stayed queued, their clients waiting, until each one's
own session timeout. The same once the slot gives up (its replacement refuses its configuration). A real authority
and agent (processes).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import trio

from .conftest import TINY, Cluster, start_authority, until, wait_for


async def one_agent_cluster(pipeline: str = TINY) -> Cluster:
    """An authority with one launched agent, ready; no token given, so only the launcher's agents can join."""

    def start() -> Cluster:
        found = start_authority(workers=1, token=None, pipeline=pipeline)
        wait_for(lambda: len(found.eligible()) == 1, "the agent to be ready", found)
        return found

    return await trio.to_thread.run_sync(start)


async def one_running_two_queued(client: httpx.AsyncClient) -> list[dict]:
    created = [(await client.post("/v1/stream/sessions", json={"identity": name})).json() for name in ("a", "b", "c")]
    assert [body["status"] for body in created] == ["assigned", "queued", "queued"], created
    return created


async def queued_ended(client: httpx.AsyncClient, cluster: Cluster, queued: list[dict]) -> list[dict]:
    """The queued sessions' records once none is queued any more."""

    async def records() -> list[dict] | None:
        found = [(await client.get(f"/v1/stream/sessions/{body['session_id']}")).json() for body in queued]
        return found if all(record["status"] != "queued" for record in found) else None

    return await until(records, "the queued sessions to end", cluster, deadline=90)


async def test_the_queue_fails_with_the_reason_once_the_last_launched_agent_is_drained() -> None:
    cluster = await one_agent_cluster()
    try:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=30) as client:
            created = await one_running_two_queued(client)
            [worker] = cluster.eligible()
            drain = await client.post(f"/v1/service/workers/{worker['worker_id']}/drain", json={"deadline_seconds": 1})
            assert drain.status_code == 202, drain.text
            why = ("no worker can take the session: local slot 0: stopped on purpose (drained, or the server is "
                   "stopping); not restarted")
            for record in await queued_ended(client, cluster, created[1:]):
                assert (record["status"], record["drain_cause"], record["error"]) == ("failed", "worker_drain", why), record
            refused = await client.post("/v1/stream/sessions", json={"identity": "d"})
            assert (refused.status_code, refused.json()["error"]) == (503, "no_worker"), refused.text
            assert "retry-after" not in refused.headers
    finally:
        await trio.to_thread.run_sync(cluster.stop)


REFUSING_WORLD = '''
def get_service(gpu_num: int = 0, **_: object) -> object:
    raise ValueError("this world takes no more sessions: the test says so")
'''


async def test_the_queue_fails_with_the_reason_once_the_last_launched_agent_gives_up(tmp_path: Path) -> None:
    """The launcher's only slot gives up (its agent was killed, and the replacement refuses its configuration: a
    pipeline redeployed broken): the queued sessions fail as ``worker_failed`` naming the slot and why; they waited
    for their own session timeout. (The same check as for a drain; a crash loop ends the same way, at its limit.)"""
    world = tmp_path / "world.py"
    world.write_text(Path(TINY).read_text())
    cluster = await one_agent_cluster(str(world))
    try:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=30) as client:
            created = await one_running_two_queued(client)
            [worker] = cluster.eligible()
            world.write_text(REFUSING_WORLD)  # the replacement agent loads this
            os.kill(worker["pid"], signal.SIGKILL)
            for record in await queued_ended(client, cluster, created[1:]):
                assert (record["status"], record["drain_cause"]) == ("failed", "worker_failed"), record
                assert record["error"].startswith("no worker can take the session: local slot 0: refused its "
                                                  "configuration; not restarted"), record
                assert "this world takes no more sessions" in record["error"], record
            refused = await client.post("/v1/stream/sessions", json={"identity": "d"})
            assert refused.status_code == 503 and "retry-after" not in refused.headers, refused.text
    finally:
        await trio.to_thread.run_sync(cluster.stop)
