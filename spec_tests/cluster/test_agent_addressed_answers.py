"""A worker agent answers a refused control to its sender alone, as an in-process worker does.

The agent's room connection (to the authority's local rooms) had no way to address a message, so an agent-run
session's ``control_rejected`` still reached every viewer. A real ``--workers local`` authority and its agent, a
controller and a viewer over the room WebSocket: the controller sends a control the protocol refuses, then a
valid one; the viewer sees the chunks that follow the answer and never the answer (a room writes to each client
in the worker's order, so an answer sent to it would come first).
"""

from __future__ import annotations

from typing import Any

import httpx
import trio

from server.transport.client import RoomClient

from .conftest import Cluster, Controller, until

DEADLINE = 60.0  # wall seconds for the messages to arrive on a loaded host (a hang bound, not a timing)



def chunks(member: Controller) -> list[int]:
    return [p["index"] for p in member.statuses("chunk")]


async def read_until(member: Controller, done: Any, what: str) -> None:
    with trio.fail_after(DEADLINE):
        while not done():
            assert await member.next() is not None, f"the room closed before {what}: {member.inbox[-3:]}"


async def test_an_agent_run_sessions_refusal_goes_to_the_controller_alone(one_agent_cluster: Cluster) -> None:
    cluster = one_agent_cluster
    await until(lambda: any(w["state"] == "idle" for w in cluster.workers()), "an idle agent", cluster)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
        controller = await Controller.open(client, cluster, "alice")
        try:
            await controller.stream(1)  # it runs on the agent
            assert (await client.get(f"/v1/stream/sessions/{controller.session_id}")).json()["worker_id"]
            asked = await client.post(f"/v1/stream/sessions/{controller.session_id}/tokens", json={"identity": "v1"})
            assert asked.status_code == 200, asked.text
            path = f"{controller.session['websocket_path']}?token={asked.json()['token']}"
            viewer = Controller(controller.session, await RoomClient.connect("127.0.0.1", cluster.port, path))
            await read_until(viewer, lambda: chunks(viewer), "the viewer's first chunk")
            await controller.ws.send_json({"topic": "tf.control", "payload": {"type": "control_state", "controls": ["q"]}})
            await read_until(controller, lambda: controller.statuses("control_rejected"), "the controller's answer")
            (answer,) = controller.statuses("control_rejected")
            assert answer["reason"] == "unknown_control", answer
            after = max(chunks(controller))
            await read_until(viewer, lambda: max(chunks(viewer)) > after + 1, "chunks after the answer")
            assert viewer.statuses("control_rejected") == [], viewer.statuses("control_rejected")
            await viewer.ws.aclose()
        finally:
            await client.delete(f"/v1/stream/sessions/{controller.session_id}")
            await controller.ws.aclose()
