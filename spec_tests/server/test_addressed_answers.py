"""An answer to one participant's message goes to that participant alone; the room's news goes to everyone.

Every viewer used to receive every ``control_rejected`` the controller drew: noise, text charged to every
participant's data pace, and one participant's actions told to the others. Through the app's room sockets
(in-process, trio's autojump clock): a controller and two viewers; the controller's refused controls (refused by
the protocol and by the service) are answered to it alone, a viewer's attempt to send is refused to it alone, and
both viewers keep receiving the chunks. The hub's side for a worker agent (``"to"`` in its envelope) is checked
on :class:`~server.transport.local.LocalRooms` itself.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from pipelines.contract import Control, ControlRejected, ControlType
from server.transport.local import LocalRooms

from .runner_fixtures import CounterService, Peer, join, make_issuer, serve, settings
from .runner_fixtures import no_threads  # noqa: F401  (fixture)


class NoPromptService(CounterService):
    """Refuses every prompt (a service's own ``ControlRejected``), takes the rest."""

    async def push_control(self, session_id: str, control: Control) -> None:
        if control.type is ControlType.PROMPT:
            raise ControlRejected("prompts are not taken here")
        await super().push_control(session_id, control)


def chunk_indexes(peer: Peer) -> list[int]:
    return [m["index"] for m in peer.status("chunk")]


def refusals(peer: Peer) -> list[str]:
    return [m["reason"] for m in peer.texts() if m["type"] == "refused"]


@pytest.mark.usefixtures("no_threads")
async def test_a_refused_control_is_answered_to_its_sender_alone_and_viewers_still_get_the_chunks(
    autojump_clock: Any,
) -> None:
    service = NoPromptService(fps=4, frames_per_chunk=1, size=(8, 8))
    async with serve(settings(), service) as served:
        created = await served.create("ctl")
        tokens = [await served.viewer_token(created["session_id"], name) for name in ("v1", "v2")]
        async with join(served, created["room"], created["token"]) as ctl, \
                join(served, created["room"], tokens[0]) as v1, join(served, created["room"], tokens[1]) as v2:
            await ctl.wait_for(lambda p: "running" in p.stages(), "the session to run")
            await ctl.control({"type": "control_state", "controls": ["q"]})  # refused by the protocol
            await ctl.control({"type": "prompt", "prompt": "a street"})  # refused by the service
            await v1.control({"type": "control_state", "controls": ["d"]})  # a viewer may not send
            answers = await ctl.wait_for(lambda p: len(p.status("control_rejected")) == 2 and p.status("control_rejected"),
                                         "both answers")
            assert [(a["reason"], a["session_id"]) for a in answers] == [
                ("unknown_control", created["session_id"]), ("service", created["session_id"])]
            assert "prompts are not taken here" in answers[1]["detail"]
            await v1.wait_for(lambda p: refusals(p), "the viewer's refusal")

            # a chunk the worker sent after its answers reaches each viewer: were they sent the answers, they would
            # have come before it (a room writes to each client in the worker's order)
            after = max(chunk_indexes(ctl), default=-1)
            for viewer in (v1, v2):
                await viewer.wait_for(lambda p: max(chunk_indexes(p), default=-1) > after, "a chunk after the answers")
                assert not viewer.status("control_rejected"), viewer.status("control_rejected")
                assert not [m for m in viewer.texts() if m["type"] == "data" and m["topic"] == "tf.status"
                            and m["payload"].get("type") not in ("status", "chunk", "lease_granted")], viewer.texts()
            assert refusals(v1) == ["publish_data_not_allowed"] and refusals(v2) == [] and refusals(ctl) == []
            assert not ctl.status("control_rejected")[2:]  # the viewer's attempt drew nothing from the worker
            (session,) = service.sessions.values()
            assert session.controls == []
            # the controller's valid control still goes through, and both viewers see its chunks
            await ctl.control({"type": "control_state", "controls": ["d"]})
            for viewer in (v1, v2):
                await viewer.wait_for(lambda p: any(m["data"]["applied_controls"]["keys"] == ["d"]
                                                    for m in p.status("chunk")), "a chunk with D held")


async def test_a_worker_agents_answer_addressed_with_to_reaches_that_client_alone() -> None:
    """A worker agent in the hub sends ``{"topic", "payload", "to"}``: the answer goes to ``to`` alone (nowhere when
    ``to`` is no name), the rest of its data to every client."""
    issuer = make_issuer()
    rooms = LocalRooms(issuer)
    room = "room-1"
    rooms.expect_worker(room, "chunkline-agent")
    inboxes: dict[str, list[dict[str, Any]]] = {}
    to_worker_in, to_worker = trio.open_memory_channel[str](8)

    def sender(name: str) -> Any:
        inboxes[name] = []

        async def send(message: str | bytes) -> None:
            inboxes[name].append(json.loads(message))

        return send

    async def silent() -> str:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async with trio.open_nursery() as nursery:
        for name, token in (("ctl", issuer.controller_token(room, "ctl")), ("v1", issuer.viewer_token(room, "v1"))):
            nursery.start_soon(rooms.serve_client, room, rooms.admit_client(room, token), sender(name), silent)
        await wait_all_tasks_blocked()
        worker = rooms.admit_client(room, issuer.worker_token(room, "chunkline-agent"))
        nursery.start_soon(rooms.serve_worker, room, worker, sender("agent"), to_worker.receive)
        await wait_all_tasks_blocked()
        for envelope in (
            {"topic": "tf.status", "payload": {"type": "control_rejected", "reason": "unknown_control"}, "to": "ctl"},
            {"topic": "tf.status", "payload": {"type": "control_rejected", "reason": "x"}, "to": 7},
            {"topic": "tf.status", "payload": {"type": "status", "stage": "running"}},
        ):
            await to_worker_in.send(json.dumps(envelope))
        await wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()

    def heard(name: str) -> list[str]:
        return [m["payload"]["type"] for m in inboxes[name] if m["type"] == "data"]

    assert heard("ctl") == ["control_rejected", "status"]
    assert heard("v1") == ["status"]
    assert [m["payload"].get("reason") for m in inboxes["ctl"] if m["type"] == "data"] == ["unknown_control", None]
