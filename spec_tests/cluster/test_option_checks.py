"""A create's options are checked by a ready agent's pipeline; an agent that never answers the check (a hung
check, or a token holder that heartbeats but stays mute) gives its turn to the next, so creates keep working."""

from __future__ import annotations

import math
import time

import httpx
import pytest
import trio

from server.cluster import wire
from server.option_check import CHECK_OPTIONS_TIMEOUT, SLOW_ANSWER, WORKER_CHECK_TIMEOUT

from .conftest import INTERVAL, TINY, TOKEN, Process, chunkline, clean_env, start_authority, until
from .wire_peer import register, say_ready

REFUSED_OPTIONS = {"identity": "ctl", "config": {"k": 1}}  # the tiny world's check refuses an option it does not know


async def mute_agent(channel: wire.Channel, asked: list[wire.Message], answer_after: float | None) -> None:
    """Heartbeat as a live agent does; take every message and answer none, or a check only ``answer_after`` s late."""
    async with trio.open_nursery() as nursery:
        async def answer_late(check_id: int) -> None:
            await trio.sleep(answer_after)  # bench-cost: the slow agent's own delay (real time)
            await channel.send(wire.OptionsChecked(check_id, refused="option 'k' is not one the tiny world takes"))

        async def heartbeat() -> None:
            seq = 0
            while True:
                seq += 1
                await channel.send(wire.Heartbeat(seq, ()))
                await trio.sleep(INTERVAL)  # bench-cost: the liveness interval a real agent keeps (real time)

        nursery.start_soon(heartbeat)
        while True:
            message = await channel.receive()
            if isinstance(message, wire.CheckOptions):
                asked.append(message)
                if answer_after is not None:
                    nursery.start_soon(answer_late, message.check_id)


def proofs(creates: list[tuple[float, bool]], answer_after: float | None) -> list[int]:
    """The creates (by index) that prove the mute or slow agent is asked last, checked as they are listed.

    Once asked it is asked last for good (it never answers within :data:`SLOW_ANSWER`). The honest agent is asked
    last too while its latest answer took past :data:`SLOW_ANSWER` (the authority's own rule, not configurable), which
    a slow host can make it do: the mute agent is then asked first again, as it should be. How long the honest agent
    took is bounded from here by a create's wall time, so a create after the first ask that followed an answer of
    the honest agent provably within :data:`SLOW_ANSWER` must not go to the mute agent (a proof); one that followed
    an answer that may have been slower may."""
    found: list[int] = []
    first = next((n for n, (_, mute_asked) in enumerate(creates) if mute_asked), len(creates))
    honest_took = 0.0  # at most, its latest answer (none yet: it is not asked last)
    for n, (took, mute_asked) in enumerate(creates):
        if n > first and honest_took <= SLOW_ANSWER:
            assert not mute_asked, (n, creates)  # asked again, though the honest agent was prompt
            found.append(n)
        if not mute_asked:
            honest_took = took  # it answered this create alone
        elif answer_after is None:
            honest_took = took - WORKER_CHECK_TIMEOUT  # asked once the mute agent's turn ran out
        elif took >= WORKER_CHECK_TIMEOUT:
            honest_took = math.inf  # asked first, it did not answer in its turn: the slow agent answered after it
        # else the slow agent's refusal answered the create: the honest agent was not asked
    return found


@pytest.mark.parametrize("answer_after", [None, 2.0], ids=["mute", "slow"])
async def test_an_agent_that_never_answers_option_checks_does_not_hold_every_create(answer_after: float | None) -> None:
    """The first ready agent was asked every time: one mute agent made every create a 503 after 10 s, while health
    said healthy. The ready agents take turns; a mute one gives its turn away at its deadline and is asked last,
    and so is one that answers, but slowly (one answering just inside the deadline held every create it was
    asked first for)."""
    authority = start_authority(launcher="external", workers=2)
    agent: Process | None = None
    try:
        channel, reply = await register(authority, "mute")
        assert isinstance(reply, wire.Welcome), reply
        asked: list[wire.Message] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mute_agent, channel, asked, answer_after)
            await say_ready(authority, channel, "mute")
            agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{authority.cluster_port}",
                                      "--node", "honest"), clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
            await until(lambda: any(w["node"] == "honest" and w["state"] == "idle" for w in authority.workers()),
                        "the real agent to be ready", authority)
            creates: list[tuple[float, bool]] = []  # each create's wall time, and whether the mute agent was asked
            async with httpx.AsyncClient(base_url=authority.base_url, timeout=CHECK_OPTIONS_TIMEOUT * 2) as http:
                while len(creates) < 4 or (len(creates) < 12 and len(proofs(creates, answer_after)) < 2):
                    before, started = len(asked), time.monotonic()
                    response = await http.post("/v1/stream/sessions", json=REFUSED_OPTIONS)
                    creates.append((time.monotonic() - started, len(asked) > before))
                    assert response.status_code == 400, response.text
                    assert response.json()["error"] == "invalid_option" and "'k'" in response.json()["detail"]
            # asked once, then after the prompt agent: every create after its first that followed a prompt answer of
            # the honest agent went to the honest one (a few of them, however slow the host)
            assert creates[0][1] or creates[1][1], creates  # the turns: it was asked in one of the first two
            assert len(proofs(creates, answer_after)) >= 2, creates
            nursery.cancel_scope.cancel()
        await channel.aclose()
    finally:
        if agent is not None:
            agent.stop()
        authority.stop()
