"""An authority that goes without a word (killed with SIGKILL, out of memory, crashed; its supervisor starts it again)
is no fault of its agents: an agent that registered and then saw the connection close or reset dials again at the
waits' pace, without counting it toward its crash-loop limit. Counted, 9 such restarts in a minute ended every
external agent for good ("crash loop: 9 failures within 60 s"). What the agent caused still counts: the authority
that drops an agent says why, in a tagged frame, before it closes.

One side each: a real agent process and the test speaking the wire as its authority, with the real proofs; a real
authority process and the test registered as an agent.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest
import trio

from server.cluster import wire
from server.cluster.agent import REREGISTER_POLICY
from server.cluster.dial_ends import DIAL_LOG_EVERY, WAIT_POLICY, End, Ended, Patience

from .conftest import TOKEN, Cluster, start_authority
from .test_agent_dial_ends import agent_dialing
from .wire_peer import register, say_ready
from .test_hostile_authority import AGENT_ENDED, START_DEADLINE, welcome

GONE = "went away without a word"


@pytest.fixture(scope="module")
def authority() -> Iterator[Cluster]:
    found = start_authority(launcher="external", workers=1)
    try:
        yield found
    finally:
        found.stop()


async def test_an_agent_whose_authority_goes_without_a_word_more_often_than_its_crash_loop_limit_dials_again() -> None:
    times = REREGISTER_POLICY.max_failures + 2  # counted, this many losses would be a crash loop
    registered_at: list[float] = []
    done = trio.Event()

    async def vanishing(stream: trio.SocketStream) -> None:
        """Each connection is an authority that takes the agent, then is gone once the agent is ready: its connection
        reset (the authority's kernel resets it when its process is killed with frames unread), or closed after it
        acknowledged a heartbeat (the kernel closes a dead process's connections)."""
        channel = wire.Channel(stream)
        try:
            await welcome(channel, TOKEN)
            registered_at.append(time.monotonic())
            if len(registered_at) > times:
                done.set()
                await trio.sleep_forever()
            if len(registered_at) % 2:
                while not isinstance(await channel.receive(), wire.Ready):
                    pass
                stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
            else:
                while not isinstance(message := await channel.receive(), wire.Heartbeat):
                    pass
                await channel.send(wire.HeartbeatAck(message.seq))
            await stream.aclose()
        except AGENT_ENDED:
            pass

    async with agent_dialing(vanishing) as agent:
        with trio.move_on_after(START_DEADLINE):
            while not done.is_set() and agent.popen.poll() is None:
                await trio.sleep(0.1)  # bench-cost: real-time poll of the agent process, bounded
        log = agent.text(200_000)
        assert done.is_set(), f"registered {len(registered_at)} times, exit code {agent.popen.poll()}:\n{log}"
        assert agent.popen.poll() is None, log
        assert GONE in log and "not counted as a crash: the authority went, not this worker" in log, log
        assert "crash loop" not in log and "Traceback" not in log, log
        # paced: the first line at once, then one with a count every DIAL_LOG_EVERY at most ...
        took = registered_at[-1] - registered_at[0]
        assert 1 <= log.count(GONE) <= 2 + took // DIAL_LOG_EVERY, log
        # ... and the dials too: each after a wait that grows (jittered down to half of it at most)
        assert took >= sum(WAIT_POLICY.delay(waits) for waits in range(1, times + 1)) / 2, registered_at


def test_an_authority_that_goes_again_and_again_is_dialed_at_the_waits_pace_for_ever() -> None:
    """No deadline ends the dials (each one registered: an authority is there), and the wait between two grows to
    the wait policy's longest: an agent is never a busy loop on an authority that takes it and goes."""
    patience = Patience()
    gone = Ended(End.AUTHORITY_GONE, "connection lost: the peer closed the connection")
    delays = []
    for second in range(1000):
        patience.registered()
        delay = patience.delay(gone, float(second))
        assert delay is not None
        delays.append(delay)
    assert min(delays[10:]) >= WAIT_POLICY.max_delay / 2


async def test_an_agent_the_authority_drops_for_its_own_fault_is_told_why_before_the_close(authority: Cluster) -> None:
    """A close with no word is the authority gone, not counted; one the agent caused (here a goodbye with no drain
    first, a protocol error) comes with the cause, proven by the frame's tag, so that the agent counts it."""
    channel, reply = await register(authority, "told-why")
    assert isinstance(reply, wire.Welcome), reply
    await say_ready(authority, channel, "told-why")
    await channel.send(wire.Goodbye("bye"))
    heard: list[wire.Message] = []
    with trio.fail_after(10):
        try:
            while True:
                heard.append(await channel.receive())  # tagged frames: another's would be a WireError here
        except wire.ConnectionClosed:
            pass
    await channel.aclose()
    cause = "protocol error: goodbye from a worker that was not draining"
    assert heard and heard[-1] == wire.Refused(f"the authority lost this worker: {cause}"), heard
