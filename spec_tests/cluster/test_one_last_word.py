"""A session's room is told once how the session ended, also when its agent fenced itself.

An agent frozen past its own fence (half the heartbeat deadline) but not the authority's stops its sessions as it runs
again, each runner telling its room ``error`` (``worker fenced: ...``), and closes its connection; the authority then
loses the agent and ended the session with its own last word: the controller got a second ``error`` (``worker lost:
connection closed``). The local room now notes that its worker said the last word, and the server says no more. A real
authority and an external agent (processes).
"""

from __future__ import annotations

import httpx
import trio

from .conftest import DEADLINE, Controller, external_agent, stopped


async def test_a_session_whose_agent_fenced_itself_ends_with_one_error_in_its_room() -> None:
    async with external_agent() as (authority, agent), httpx.AsyncClient(base_url=authority.base_url,
                                                                                    timeout=10) as client:
        controller = await Controller.open(client, authority, "alice")
        await controller.stream(2)
        with stopped(agent.popen.pid):
            await trio.sleep(DEADLINE * 0.75)  # bench-cost: frozen past the agent's own fence, short of the authority's
        with trio.fail_after(30):
            while await controller.next() is not None:  # to the room's close: the server sends its clients away
                pass
        errors = controller.statuses("error")
        assert len(errors) == 1, errors
        assert errors[0]["detail"].startswith("worker fenced: "), errors
        record = (await client.get(f"/v1/stream/sessions/{controller.session_id}")).json()
        assert record["status"] == "failed", record
