"""How a session on an agent ends, as the authority's API reports it: the same as a session run in-process.

The agent's runner drains with a cause (its controller never came, left, or sent ``stop``); the authority's
record must drain with that cause and settle as the table says for it (failed for the controller's absence,
closed for ``stop``), with the reason in words, the room empty and the metrics counting it where it belongs.
Real processes: ``chunkline stream-serve --workers local`` and its agent, driven over HTTP and the room socket.
"""

from __future__ import annotations

import base64
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from server.tokens import SERVER_STATUS_IDENTITY
from server.transport.client import RoomClient

from ..server.conftest import png_bytes
from .conftest import Cluster, Controller, start_cluster, until

CONTROLLER_TIMEOUT = 3.0
END_BOUND = CONTROLLER_TIMEOUT + 30.0  # a hang bound on a loaded host, not a measurement
TERMINAL = {"closed", "failed", "expired"}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary directory of the module's authority and agents."""
    return tmp_path_factory.mktemp("cluster-tmp")


@pytest.fixture(scope="module")
def short_timeouts(scratch: Path) -> Iterator[Cluster]:
    cluster = start_cluster("--max-sessions-per-worker", "3", "--controller-timeout", str(CONTROLLER_TIMEOUT),
                            "--room-empty-timeout", "60", workers=1, tmpdir=scratch)
    try:
        yield cluster
    finally:
        cluster.stop()


async def ended(client: httpx.AsyncClient, session_id: str, cluster: Cluster) -> dict[str, Any]:
    async def terminal() -> dict[str, Any] | None:
        found = (await client.get(f"/v1/stream/sessions/{session_id}")).json()
        return found if found["status"] in TERMINAL else None

    return await until(terminal, f"session {session_id} to end", cluster, deadline=END_BOUND)


def finished(metrics: str, result: str) -> float:
    line = f'chunkline_sessions_finished_total{{result="{result}"}} '
    return float(next(row for row in metrics.splitlines() if row.startswith(line))[len(line):])


async def test_sessions_on_an_agent_end_with_their_cause_reason_and_an_empty_room(short_timeouts: Cluster) -> None:
    cluster = short_timeouts
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
        before = (await client.get("/metrics")).text
        absent = (await client.post("/v1/stream/sessions", json={"identity": "nobody"})).json()
        stopped = await Controller.open(client, cluster, "stopper")
        leaving = await Controller.open(client, cluster, "leaver")
        viewer_token = (await client.post(f"/v1/stream/sessions/{leaving.session_id}/tokens",
                                          json={"identity": "watcher"})).json()["token"]
        viewer = await RoomClient.connect("127.0.0.1", cluster.port,
                                          f"{leaving.session['websocket_path']}?token={viewer_token}")
        try:
            await stopped.stream(2)
            await leaving.stream(2)
            await stopped.ws.send_json({"topic": "tf.control", "payload": {"type": "stop"}})
            await leaving.ws.aclose()  # the controller leaves for good; a viewer stays, so the room is not empty

            for_absent = await ended(client, absent["session_id"], cluster)
            for_stop = await ended(client, stopped.session_id, cluster)
            for_leaving = await ended(client, leaving.session_id, cluster)
        finally:
            with trio.CancelScope(shield=True):
                await viewer.aclose()
                await stopped.ws.aclose()
        after = (await client.get("/metrics")).text

    assert (for_absent["status"], for_absent["drain_cause"]) == ("failed", "controller_absent"), for_absent
    assert "'nobody'" in for_absent["error"], for_absent
    assert (for_stop["status"], for_stop["drain_cause"], for_stop["error"]) == ("closed", "stop", None), for_stop
    assert (for_leaving["status"], for_leaving["drain_cause"]) == ("failed", "controller_left"), for_leaving
    assert "'leaver'" in for_leaving["error"], for_leaving
    # the worker left with the session and its clients were sent away: nobody is counted in its room
    assert [r["participant_count"] for r in (for_absent, for_stop, for_leaving)] == [0, 0, 0]
    assert finished(after, "failed") - finished(before, "failed") == 2
    assert finished(after, "closed") - finished(before, "closed") == 1


async def test_the_image_folder_of_a_killed_agent_is_removed_by_its_replacement(
    short_timeouts: Cluster, scratch: Path
) -> None:
    """kill -9 skips every cleanup: the agent's copy of a session's uploaded image stays in its folder, which is
    named by its process id, until its replacement starts on the host and removes what a dead process left."""
    cluster = short_timeouts
    (agent,) = await until(lambda: [w for w in cluster.workers() if w["state"] in ("idle", "busy")], "a ready agent",
                           cluster)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
        response = await client.post("/v1/stream/sessions", json={
            "identity": "painter", "image_b64": base64.b64encode(png_bytes()).decode()})
        assert response.status_code == 200, response.text
        created = response.json()
        ws = await RoomClient.connect("127.0.0.1", cluster.port, f"{created['websocket_path']}?token={created['token']}")
        controller = Controller(created, ws)
        try:
            await controller.stream(2)
            left = list(scratch.glob(f"chunkline-agent-{agent['pid']}-*/*"))
            assert len(left) == 1, list(scratch.rglob("*"))  # the agent's copy of the image, while the session runs
            os.kill(agent["pid"], signal.SIGKILL)
            failed = await ended(client, controller.session_id, cluster)
            assert failed["status"] == "failed" and failed["error"].startswith("worker lost"), failed
            await told_and_sent_away(controller, failed)
            await until(lambda: [w for w in cluster.workers() if w["state"] == "idle" and w["pid"] != agent["pid"]],
                        "the replacement agent", cluster)
        finally:
            with trio.CancelScope(shield=True):
                await ws.aclose()
    assert not list(scratch.glob(f"chunkline-agent-{agent['pid']}-*")), list(scratch.rglob("*"))


async def told_and_sent_away(controller: Controller, record: dict[str, Any]) -> None:
    """The agent could not say how the session ended: the authority told the room, then closed it."""
    with trio.fail_after(END_BOUND):
        while await controller.next() is not None:
            pass
    (error,) = controller.statuses("error")
    assert error["detail"] == record["error"] and error["session_id"] == record["session_id"], error
    assert controller.inbox[-1].get("from") == SERVER_STATUS_IDENTITY, controller.inbox[-1]


async def test_a_frozen_agents_session_is_ended_for_its_room_at_once_when_the_agent_is_lost(
    short_timeouts: Cluster,
) -> None:
    """SIGSTOP: the authority gives the agent up at its heartbeat deadline and fails the session; the room's
    clients are told and sent away then, not when the frozen agent's room socket finally times out."""
    cluster = short_timeouts
    (agent,) = await until(lambda: [w for w in cluster.workers() if w["state"] == "idle"], "an idle agent", cluster)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
        controller = await Controller.open(client, cluster, "freezer")
        try:
            await controller.stream(2)
            os.kill(agent["pid"], signal.SIGSTOP)
            try:
                failed = await ended(client, controller.session_id, cluster)
                assert failed["status"] == "failed" and failed["error"].startswith("worker lost"), failed
                await told_and_sent_away(controller, failed)
            finally:
                os.kill(agent["pid"], signal.SIGKILL)  # its launcher replaces it
        finally:
            with trio.CancelScope(shield=True):
                await controller.ws.aclose()
        await until(lambda: [w for w in cluster.workers() if w["state"] == "idle" and w["pid"] != agent["pid"]],
                    "the replacement agent", cluster)
