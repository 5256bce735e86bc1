"""A session its agent reports draining (its runner's own drain: the controller never came or left, the room emptied,
the agent's own drain) and then never reports finished: it stayed ``draining``, its slot held, for as long as the
agent kept heartbeating. A Stop's deadline covered only the drains the authority asks for; now the agent owes the
finish of a drain it reports within the same bound (``server.cluster.session_deadlines.DRAIN_DEADLINE``), or it is
lost as past a Stop's deadline, and its sessions fail with that cause. And the authority's wait on a placed session's
start ends as the session runs or drains: a task slept the whole start deadline for every session placed.

The authority runs in this process under trio's MockClock, over HTTP through the app's test client; the agents are
the test, speaking the wire (``spec_tests/cluster/test_start_deadline.py``).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from server.cluster import wire
from server.cluster.session_deadlines import DRAIN_DEADLINE

from ..virtual_time import elapse
from .test_start_deadline import INTERVAL, SESSIONS, Authority, SilentAgent, in_process_authority, silent_agent

STARTING = ("join_room",)
RUNNING = ("join_room", "start_pipeline", "run")


async def report(agent: SilentAgent, session_id: str, events: tuple[str, ...], cause: str | None = None, *,
                 after: int = 0) -> int:
    """The agent's runner reports its progress, then (with ``cause``) its own drain, as a real agent's does, numbered
    from ``after``; the last sequence number it used."""
    seq = after
    for seq, event in enumerate(events, after + 1):
        await agent.channel.send(wire.SessionEvent(session_id, seq, event))
    if cause is not None:
        seq += 1
        await agent.channel.send(wire.SessionEvent(session_id, seq, "drain", drain_cause=cause,
                                                   drain_detail=f"the runner drained: {cause}"))
    await elapse(INTERVAL)  # heard
    return seq


async def status_of(authority: Authority, session_id: str) -> dict:
    status, record = await authority.json("get", f"{SESSIONS}/{session_id}")
    assert status == 200, record
    return record


@pytest.mark.parametrize(("progress", "cause", "agent_drain"), [
    (STARTING, "controller_absent", None),  # its controller never came: the runner drains before it runs
    (RUNNING, "room_empty", None),  # its room emptied while it ran
    (RUNNING, "controller_left", 3600.0),  # during its agent's own drain, whose deadline is an hour away
], ids=["while-starting", "while-running", "during-its-agents-drain"])
async def test_an_agent_that_never_finishes_a_session_it_drained_itself_is_lost_at_the_drain_deadline(
    autojump_clock: trio.testing.MockClock, progress: tuple[str, ...], cause: str, agent_drain: float | None,
) -> None:
    async with (in_process_authority() as authority, silent_agent(authority, "mute") as mute,
                silent_agent(authority, "honest") as honest):
        await elapse(INTERVAL)  # both Readys heard
        placed = {}
        for identity in ("alice", "bob"):
            status, created = await authority.json("post", SESSIONS, json={"identity": identity})
            assert status == 200, created
            placed[created["worker_id"]] = created["session_id"]
        assert set(placed) == {"mute", "honest"}, placed
        for agent in (mute, honest):
            await agent.expect(wire.Start)
        if agent_drain is not None:
            await mute.channel.send(wire.Drain(agent_drain))
        reported = trio.current_time()
        seqs = {}
        for name, agent in (("mute", mute), ("honest", honest)):  # both runners drain on their own, no Stop asked
            seqs[name] = await report(agent, placed[name], progress, cause)
        status, queued = await authority.json("post", SESSIONS, json={"identity": "carol"})
        assert status == 202 and queued["queue_position"] == 1, queued  # both slots are held by draining sessions

        await elapse(reported + DRAIN_DEADLINE - 1.0 - trio.current_time())
        for name in ("mute", "honest"):
            assert (await status_of(authority, placed[name]))["status"] == "draining"
        # an honest agent finishes within the deadline: it keeps serving, and its slot takes the queued session
        await honest.channel.send(wire.SessionFinished(placed["honest"], seqs["honest"] + 1, None, cause))
        start = await honest.expect(wire.Start)
        assert start.session_id == queued["session_id"], start

        await elapse(2.0)  # past the deadline: the agent that never finished its session is lost
        assert mute.closed.is_set() and not honest.closed.is_set()
        status, metadata = await authority.json("get", "/v1/service/metadata")
        [loss] = metadata["cluster"]["recent_losses"]
        expected = (f"protocol error: session {placed['mute']} not reported finished within {DRAIN_DEADLINE:g} s of "
                    "the drain its agent reported")
        assert (loss["worker_id"], loss["cause"]) == ("mute", expected), loss
        record = await status_of(authority, placed["mute"])
        assert (record["status"], record["drain_cause"], record["error"]) == ("failed", cause, f"worker lost: {expected}")
        status, health = await authority.json("get", "/v1/stream/health")
        assert [w["worker_id"] for w in health["workers"]] == ["honest"], health
        assert (await status_of(authority, queued["session_id"]))["worker_id"] == "honest"


def start_waits() -> int:
    """Tasks of this run waiting on a placed session's start (``RemoteRun.hold_to_start``): nothing public shows
    a task that sleeps on, so the test counts them in trio's task tree."""
    def count(task: trio.lowlevel.Task) -> int:
        return task.name.endswith(".hold_to_start") + sum(
            count(child) for nursery in task.child_nurseries for child in nursery.child_tasks)

    return count(trio.lowlevel.current_root_task())


async def test_nothing_waits_on_a_session_s_start_once_it_runs_or_drains(autojump_clock: trio.testing.MockClock) -> None:
    async with in_process_authority() as authority, silent_agent(authority, "prompt") as agent:
        await elapse(INTERVAL)
        status, created = await authority.json("post", SESSIONS, json={"identity": "alice"})
        first = created["session_id"]
        await agent.expect(wire.Start)
        assert start_waits() == 1
        seq = await report(agent, first, STARTING)
        assert start_waits() == 1  # joining its room: still starting
        seq = await report(agent, first, RUNNING[1:], after=seq)
        assert (await status_of(authority, first))["status"] == "running"
        assert start_waits() == 0  # it runs: the wait ended then, not at the start deadline

        status, created = await authority.json("post", SESSIONS, json={"identity": "bob"})
        second = created["session_id"]
        await agent.channel.send(wire.SessionFinished(first, seq + 1, None, "completed"))
        assert (await agent.expect(wire.Start)).session_id == second
        assert start_waits() == 1
        seq = await report(agent, second, STARTING, "controller_absent")  # its controller never came: it drains
        assert (await status_of(authority, second))["status"] == "draining"
        assert start_waits() == 0
        await agent.channel.send(wire.SessionFinished(second, seq + 1, None, "controller_absent"))
        await elapse(INTERVAL)
        record = await status_of(authority, second)
        assert (record["status"], record["drain_cause"]) == ("failed", "controller_absent"), record
