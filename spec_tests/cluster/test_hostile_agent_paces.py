"""A token holder's agent that sends too much, on the cluster port of a real ``--workers external`` authority: its
connection is read at a pace and its comings and goings are logged at one, and the authority serves on.

The peers here speak the wire themselves (``server.cluster.wire``), as a hostile or buggy agent would.
"""

from __future__ import annotations

import time

import pytest
import trio

from server.cluster import wire
from server.cluster.agent_pace import AGENT_MESSAGE_BURST, AGENT_MESSAGES_PER_S
from server.log_pace import WORKER_LINES_BURST, WORKER_LINES_PER_SECOND

from .conftest import Cluster, until
from .wire_peer import losses, register, say_ready, still_serving


@pytest.fixture(scope="module")
def authority(external_authority: Cluster) -> Cluster:
    """An authority of one external worker, the module's own (these tests use up its log's pace)."""
    return external_authority


async def test_a_token_holder_flooding_session_events_is_read_at_a_pace_and_the_authority_serves_on(
    authority: Cluster,
) -> None:
    """Session events for a session it does not run, as fast as its socket takes them: each is read, checked and
    dropped, with no answer, so no outbox filled and the agent was never told off. 10,000 a second held a core of the
    authority for as long as it went on, its HTTP API answered 100-300 times slower, and its rooms' frames came at
    half their pace. Its connection is now read no faster than its pace (a burst, then so many a second), which the
    log names once; the agent lives on, heard, and the authority takes the next agent as ever."""
    channel, reply = await register(authority, "flooder")
    assert isinstance(reply, wire.Welcome), reply
    await say_ready(authority, channel, "flooder")
    before = authority.get("/v1/service/metadata")["cluster"]["stale_messages_dropped"]
    started = time.monotonic()
    seq = 0
    with trio.move_on_after(2.0):
        while True:
            seq += 1
            await channel.send(wire.SessionEvent("not-its-session", seq, "run"))
    # what the authority read of it: its stale events, counted as it drops them (it reads on at its pace while the
    # count is fetched, so the time the pace is held to runs until the count came back)
    read = authority.get("/v1/service/metadata")["cluster"]["stale_messages_dropped"] - before
    flooded = time.monotonic() - started
    assert read <= AGENT_MESSAGE_BURST + AGENT_MESSAGES_PER_S * flooded * 1.25, (read, seq, flooded)
    assert seq > read, (read, seq)  # it sent more than was read: the rest waited in its socket
    assert authority.process.text(200_000).count("worker flooder sends faster than 500 messages a second") == 1
    assert "flooder" not in losses(authority)  # heard all along: paced, not lost
    await channel.aclose()
    await still_serving(authority, "after-the-flood")


async def test_an_agent_registering_and_leaving_in_a_loop_logs_its_comings_and_goings_at_a_pace(
    authority: Cluster,
) -> None:
    """A token holder that registered and closed in a loop (111 times a second) wrote a "registered" and a "lost" line
    each time, unpaced: 6,666 lines in 20 s. Those lines now come at a pace (a burst large enough for a big cluster's
    start, then two a second), each saying how many like it were left out."""
    started = time.monotonic()
    rounds = WORKER_LINES_BURST
    for n in range(rounds):
        channel, reply = await register(authority, f"churn-{n}")
        assert isinstance(reply, wire.Welcome), reply
        await channel.aclose()
    await until(lambda: f"churn-{rounds - 1}" in losses(authority), "the last round to be lost", authority, deadline=30)
    took = time.monotonic() - started
    lines = [line for line in authority.process.text(10_000_000).splitlines() if "cluster: worker churn-" in line]
    assert len(lines) <= WORKER_LINES_BURST + WORKER_LINES_PER_SECOND * took + 2, (len(lines), took)  # 2 a round
    # the lines left out are counted on the next one logged: on a fast host the whole churn can fit before the pace
    # lets another line through, so one more comes once it does
    await trio.sleep(1.2 / WORKER_LINES_PER_SECOND)  # bench-cost: real time for the pace to let one more line through
    channel, reply = await register(authority, "churn-after")
    assert isinstance(reply, wire.Welcome), reply
    await channel.aclose()
    await until(lambda: "churn-after" in losses(authority), "the round after the churn to be lost", authority)
    lines = [line for line in authority.process.text(10_000_000).splitlines() if "cluster: worker churn-" in line]
    assert any("more like it were not logged" in line for line in lines), lines[-3:]
    await still_serving(authority, "after-the-churn")
