"""What a real worker agent does with the authority's answer to its Register, judged by what the answer proves
(``server/cluster/dial_ends.py``): a proven transient refusal is waited out, more often than the crash-loop limit
allows, and not counted; a proven permanent one exits 3 with its reason; a Busy nobody proved (an impostor at the
authority's address) counts as a failed connect, so it cannot keep the agent idle for ever; a crash loop of hellos
of another wire protocol exits 3; dials that an authority (or an address) closes before its hello are dialed again
uncounted, up to the unreachable deadline. Those waited dials are logged at a pace: the first, then a line with the
count every ``DIAL_LOG_EVERY`` seconds at most, and the count once the agent registers.

The authority here is the test, speaking the wire (``server.cluster.wire``) with the real proofs."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from server.cluster import proofs, wire
from server.cluster.agent import EXIT_REFUSED, REREGISTER_POLICY
from server.cluster.dial_ends import DIAL_LOG_EVERY, NOT_AN_AUTHORITY_DEADLINE, End, Ended, Patience

from .conftest import TINY, TOKEN, Process, chunkline, clean_env
from .test_hostile_authority import START_DEADLINE, serve, welcome

NOT_YET = "the authority does not know its rooms URL yet; try again"


async def greet(channel: wire.Channel) -> wire.Register:
    await channel.send(wire.Hello("n0nce", "any"))
    register = await channel.receive()
    assert isinstance(register, wire.Register), register
    return register


def refusal(register: wire.Register, reason: str, *, transient: bool, token: str = TOKEN) -> wire.Refused:
    proof = proofs.refusal_proof(token, "n0nce", register.agent_nonce, register.worker_id, reason, transient)
    return wire.Refused(reason, proof, transient)


@asynccontextmanager
async def agent_dialing(handler: Callable[[trio.SocketStream], Awaitable[None]], scheme: str = "tcp"
                        ) -> AsyncIterator[Process]:
    """A real agent process dialing ``handler`` (``scheme``: ``tcp`` or ``tls``), which answers each of its
    connections; stopped at the end."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, handler)
        agent = Process(chunkline("worker", TINY, "--authority", f"{scheme}://127.0.0.1:{port}"),
                        clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
        try:
            yield agent
        finally:
            agent.stop()
            nursery.cancel_scope.cancel()


#: the count a waited dial's line carries (dial_ends.DialLog)
WAITED_DIALS = re.compile(r"(\d+) dials in \d+ s have not registered")


def waited_dials(log: str) -> int:
    """The most waited dials the agent's paced lines counted so far."""
    return max((int(count) for count in WAITED_DIALS.findall(log)), default=0)


def paced(log: str, why: str, seconds: float) -> bool:
    """At most the first line saying ``why`` and one each DIAL_LOG_EVERY since (one a dial, it flooded the log)."""
    return 1 <= log.count(why) <= 2 + seconds // DIAL_LOG_EVERY


def counting(handler: Callable[[trio.SocketStream], Awaitable[None]]) -> tuple[list[int], Callable[..., Any]]:
    """``handler`` with a count of the connections it answered."""
    dials = [0]

    async def counted(stream: trio.SocketStream) -> None:
        dials[0] += 1
        await handler(stream)

    return dials, counted


async def dialed_uncounted_past_the_crash_loop_limit(agent: Process, why: str, dials: list[int]) -> str:
    """Wait until the agent dialed (``dials``: the answering side's count) more often than its crash-loop limit
    allows, each ending with ``why``; it must still run, each dial not counted, and have logged them paced. Returns
    its log."""
    times = REREGISTER_POLICY.max_failures + 2  # past the crash-loop limit, had these counted
    with trio.fail_after(START_DEADLINE):
        while why not in agent.text(200_000):
            await trio.sleep(0.1)  # bench-cost: real-time poll of the agent process, bounded
        began = time.monotonic()
        while dials[0] < times + 1:
            await trio.sleep(0.1)  # bench-cost: real-time poll of the agent process, bounded
    log = agent.text(200_000)
    assert agent.popen.poll() is None, log
    assert "not counted as a crash" in log and "crash loop" not in log and "Traceback" not in log, log
    assert paced(log, why, time.monotonic() - began), log
    return log


async def exit_code(agent: Process, deadline: float) -> int | None:
    """The agent's exit code within ``deadline`` seconds, or None if it still runs then (once it exited, its log is
    read to its end: the last lines may trail the exit)."""
    with trio.move_on_after(deadline):
        while agent.popen.poll() is None:
            await trio.sleep(0.1)  # bench-cost: real-time poll of the agent process, bounded
    if agent.popen.poll() is None:
        return None
    return await trio.to_thread.run_sync(agent.stop)


async def test_a_proven_transient_refusal_is_waited_out_uncounted_and_a_permanent_one_exits_3() -> None:
    times = REREGISTER_POLICY.max_failures + 2  # counted, this many would be a crash loop
    dials = 0
    registered = trio.Event()

    async def authority(stream: trio.SocketStream) -> None:
        nonlocal dials
        dials += 1
        channel = wire.Channel(stream)
        try:
            if dials <= times:
                await channel.send(refusal(await greet(channel), NOT_YET, transient=True))
            elif dials == times + 1:
                await welcome(channel, TOKEN)
                while not isinstance(message := await channel.receive(), wire.Heartbeat):
                    pass
                await channel.send(wire.HeartbeatAck(message.seq))
                registered.set()  # then it closes: the agent dials again
            else:
                await channel.send(refusal(await greet(channel), "pipeline 'x' differs from the authority's", transient=False))
            await channel.aclose()
        except (wire.ConnectionClosed, wire.WireError):
            pass

    async with agent_dialing(authority) as agent:
        with trio.move_on_after(START_DEADLINE):
            while not dials and agent.popen.poll() is None:
                await trio.sleep(0.1)  # bench-cost: real-time poll of the agent process, bounded
            began = time.monotonic()
            while not registered.is_set() and agent.popen.poll() is None:
                await trio.sleep(0.1)  # bench-cost: real-time poll of the agent process, bounded
        assert registered.is_set(), f"the agent never registered (exit code {agent.popen.poll()}):\n{agent.text()}"
        refused_for = time.monotonic() - began
        code = await exit_code(agent, 60)
        log = agent.text(200_000)
        assert code == EXIT_REFUSED, log
        # the transient refusals: not counted as a crash, logged at a pace (it logged each one), counted once
        # it registered
        assert paced(log, "refused this worker for now", refused_for), log
        assert f"after {times} dials over" in log, log
        assert "the authority refused this worker: pipeline 'x' differs" in log, log
        assert "crash loop" not in log and "Traceback" not in log, log


async def test_a_busy_nobody_proved_counts_as_a_failed_connect_and_ends_in_a_crash_loop() -> None:
    """An impostor that says busy on every dial (in place of the hello, or after the register with a proof under
    another token) cannot keep the agent idle: the agent counts each one, and gives up at its crash-loop limit.
    Its log repeats the impostor's words cut short."""
    dials = 0
    heard: list[Any] = []

    async def impostor(stream: trio.SocketStream) -> None:
        nonlocal dials
        dials += 1
        channel = wire.Channel(stream)
        try:
            if dials % 2:
                await channel.send(wire.Busy("32 registrations pending; dial again later " + "x" * 5000))
            else:
                register = await greet(channel)
                heard.append(register)
                reason = "32 registrations pending; dial again later"
                forged = proofs.busy_proof("not-the-cluster-token", "n0nce", register.agent_nonce, register.worker_id,
                                           reason)
                await channel.send(wire.Busy(reason, forged))  # proven under another token: proves nothing here
            await channel.aclose()
        except (wire.ConnectionClosed, wire.WireError):
            pass

    async with agent_dialing(impostor) as agent:
        # the crash loop's backoffs add up to ~20 s once the model is loaded
        code = await exit_code(agent, START_DEADLINE)
        log = agent.text(200_000)
        assert code == 1, log
        assert log.count("said busy without proving the cluster token") == REREGISTER_POLICY.max_failures + 1, log
        assert "crash loop" in log and "busy without proof" in log, log
        # what the impostor said is repeated only cut short (server.reasons.echo; it was the first 200 characters)
        assert "... (5043 characters in all)" in log and "x" * 100 not in log, log
        assert "the authority is busy" not in log and "Traceback" not in log, log
        assert heard, "the impostor never heard a register"


async def test_an_authority_of_another_wire_protocol_ends_the_agent_with_exit_3_after_a_crash_loop() -> None:
    """A hello of another protocol version proves nothing (anyone can send one), so the agent counts it and dials
    again; at its crash-loop limit it exits 3 with the reason, as for any refusal it could not check."""

    async def other_version(stream: trio.SocketStream) -> None:
        channel = wire.Channel(stream)
        try:
            await channel.send_body(json.dumps({"v": 99, "type": "hello", "nonce": "n", "authority_version": "x"}).encode())
            await channel.receive()  # the agent closes: ConnectionClosed ends this
        except (wire.ConnectionClosed, wire.WireError):
            pass

    async with agent_dialing(other_version) as agent:
        code = await exit_code(agent, START_DEADLINE)
        log = agent.text(200_000)
        assert code == EXIT_REFUSED, log
        assert log.count("speaks another wire protocol: protocol version 99 is not supported "
                         f"(this side speaks {wire.PROTOCOL})") == REREGISTER_POLICY.max_failures + 1, log
        assert "crash loop" in log and "Traceback" not in log, log


async def test_an_address_that_answers_but_not_as_an_authority_is_named_and_dialed_uncounted_up_to_a_deadline() -> None:
    """The HTTP port given for the cluster port: each dial met an HTTP answer (or no hello in 10 s), was counted as
    a failed connect, never filled the crash-loop window at 10 s a dial, and went on for ever as "unreachable"."""

    async def http_server(stream: trio.SocketStream) -> None:
        try:
            await stream.send_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except trio.BrokenResourceError:
            pass
        await stream.aclose()

    dials, counted = counting(http_server)
    async with agent_dialing(counted) as agent:
        log = await dialed_uncounted_past_the_crash_loop_limit(agent, "answers, but not as a chunkline authority", dials)
        assert "(it begins 'HTTP': another protocol's text, not a frame) (is this the --cluster-port, not the HTTP " \
               "port?)" in log, log
    # a tls:// agent at a port that speaks no TLS is told so: it was asked whether that was the --cluster-port
    async with agent_dialing(http_server, scheme="tls") as agent:
        with trio.fail_after(START_DEADLINE):
            while "TLS failed" not in agent.text(200_000):
                await trio.sleep(0.1)  # bench-cost: real-time poll of the agent process, bounded
        log = agent.text(200_000)
        assert "(no TLS there: a plain cluster port, dialed tcp://, or not the --cluster-port)" in log, log
        assert "not the HTTP port?" not in log, log
    # the run ends at its deadline, with exit 3 (another agent given this address would fail the same way)
    patience = Patience()
    ended = Ended(End.NOT_AN_AUTHORITY, "no hello within 10 s")
    assert patience.delay(ended, 0.0) is not None
    assert patience.delay(ended, NOT_AN_AUTHORITY_DEADLINE - 1) is not None
    assert patience.delay(ended, NOT_AN_AUTHORITY_DEADLINE + 1) is None


async def test_dials_closed_before_a_hello_are_dialed_again_uncounted() -> None:
    """An authority flooded past its busy answers closes a connection unanswered: anyone who could open
    connections (no token needed) made every dial of an agent then starting count as a failed connect, and the
    agent gave up for good in some 20 s ("crash loop: 9 failures within 60 s")."""

    async def shedding(stream: trio.SocketStream) -> None:
        await stream.aclose()  # what a flooded authority does past its busy answers

    dials, counted = counting(shedding)
    async with agent_dialing(counted) as agent:
        log = await dialed_uncounted_past_the_crash_loop_limit(agent, "closed the connection before its hello", dials)
        assert "is unreachable" in log, log


def test_the_patience_a_dial_line_gives_agrees_with_the_lines_that_follow() -> None:
    """After an authority's goodbye the agent said it dialed "waited out however long it lasts", and its next line, the
    authority now unreachable, that it gave up after 300 s: each kind's words now say both."""
    from server.cluster.dial_ends import UNREACHABLE_DEADLINE, patience_of

    for kind in (End.AUTHORITY_STOPPED, End.BUSY):
        said = patience_of(kind)
        assert "however long" not in said and f"given up after {UNREACHABLE_DEADLINE:g} s" in said, said
    assert patience_of(End.UNREACHABLE).endswith(f"gives up after {UNREACHABLE_DEADLINE:g} s of such dials")
