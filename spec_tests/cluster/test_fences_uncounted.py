"""A fence is no crash of the agent's: a registration that ends in one is dialed again without counting it toward the
agent's crash-loop limit (``server/cluster/dial_ends.py``: ``End.FENCED``).

An authority that acknowledges no heartbeat (it stalls, again and again) made its agent fence itself each time, and each
fence counted as a failure ("restart 1 of 8 ...", then 2, ...): an external agent, which no launcher replaces, was
pushed toward giving up for good (exit 3) by the authority's own stalls. Likewise the authority's tagged word that it
lost the agent on the heartbeat clock (a transient loss notice). A fake authority that welcomes every dial and
acknowledges nothing, and a real agent process.
"""

from __future__ import annotations

import trio

from server.cluster import wire

from .conftest import TOKEN, Cluster, agent_dialing, external_agent, stopped, until
from .test_agent_start_signals import logged
from .test_hostile_authority import AGENT_ENDED, START_DEADLINE, serve, welcome

#: the Welcome's heartbeat deadline: the agent fences itself half of it after its register, unacknowledged
SHORT_DEADLINE = 0.6
FENCES = 3  # registrations fenced in a row: each would have counted toward the limit
UNCOUNTED = "not counted as a crash: a fence is the authority's silence or verdict, not this worker failing"


class SilentAuthority:
    """Welcomes every dial with a short heartbeat deadline, then acknowledges nothing until the agent leaves."""

    def __init__(self) -> None:
        self.registrations = 0
        self.enough = trio.Event()

    async def answer(self, stream: trio.SocketStream) -> None:
        channel = wire.Channel(stream)
        try:
            await welcome(channel, TOKEN, deadline=SHORT_DEADLINE)
            self.registrations += 1
            if self.registrations >= FENCES:
                self.enough.set()
            while True:
                await channel.receive()  # heartbeats, never acknowledged
        except AGENT_ENDED:
            pass
        finally:
            await channel.aclose()


async def test_fences_in_a_row_are_not_counted_toward_the_agents_crash_loop_limit() -> None:
    authority = SilentAuthority()
    async with trio.open_nursery() as nursery:
        agent = agent_dialing(await nursery.start(serve, authority.answer))
        try:
            await logged(agent, "registered as", START_DEADLINE)
            with trio.fail_after(60):
                await authority.enough.wait()
            await logged(agent, UNCOUNTED, 30)
            assert agent.popen.poll() is None, agent.text()
        finally:
            agent.stop()
            nursery.cancel_scope.cancel()
    log = agent.text(200_000)
    assert "no heartbeat acknowledged: fenced before the authority's deadline" in log, log
    assert "; restart 1 of" not in log and "crash loop" not in log, log


async def test_the_authoritys_word_that_it_lost_a_frozen_agent_on_the_heartbeat_clock_is_not_counted() -> None:
    """A frozen agent (SIGSTOP past the heartbeat deadline) is lost as ``heartbeat missed``; the authority's tagged
    notice says it is a fence (transient), and the agent, running again, dials again uncounted and registers anew."""
    async with external_agent() as (authority, agent):
        [first] = authority.eligible()
        with stopped(agent.popen.pid):
            await until(lambda: first["worker_id"] in lost(authority), "the frozen agent to be lost", authority,
                        deadline=30)
        await until(lambda: agent.text(200_000).count("registered as") == 2, "the agent to register again", authority,
                    deadline=30)
        assert lost(authority)[first["worker_id"]].startswith("heartbeat missed"), lost(authority)
    log = agent.text(200_000)
    assert UNCOUNTED in log, log
    assert "; restart 1 of" not in log and "authority connection ended" not in log, log


def lost(authority: Cluster) -> dict[str, str]:
    """The authority's recent losses: worker id -> cause."""
    return {loss["worker_id"]: loss["cause"] for loss in authority.get("/v1/service/metadata")["cluster"]["recent_losses"]}
