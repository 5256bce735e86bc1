"""A test peer that speaks the cluster wire as an agent does (``server.cluster.wire``), for tests that play a hostile,
buggy or scripted agent against a real authority: dial, register with the right token (its answer's proof checked),
report ready, heartbeat until lost, and read what the authority says of its losses."""

from __future__ import annotations

import time

import trio

from server.cluster import proofs, wire
from server.cluster.authority import HANDSHAKE_TIMEOUT
from server.cluster.identity import chunkline_version, pipeline_digest, pipeline_name

from .conftest import INTERVAL, TINY, TOKEN, Cluster, until

__all__ = ["PLAN", "dial", "register", "still_serving", "closed_by_peer", "losses", "say_ready", "sent_before_the_end",
           "heartbeat_until_lost"]

#: the capacity plan a test agent reports in its Ready: one session
PLAN = {"computed_capacity": None, "effective_capacity": 1, "configured_limit": 1, "limiting_device": None}


async def dial(cluster: Cluster) -> tuple[trio.SocketStream, wire.Channel, wire.Hello]:
    stream = await trio.open_tcp_stream("127.0.0.1", cluster.cluster_port)
    channel = wire.Channel(stream)
    with trio.fail_after(HANDSHAKE_TIMEOUT):
        hello = await channel.receive()
    assert isinstance(hello, wire.Hello)
    return stream, channel, hello


async def register(cluster: Cluster, worker_id: str, *, version: str | None = None) -> tuple[wire.Channel, wire.Message]:
    """A registration with the right token and pipeline (and version, unless given); the authority's answer,
    its proof checked (after a Welcome that proves the token, the channel tags its frames as an agent's does)."""
    _, channel, hello = await dial(cluster)
    await channel.send(wire.Register(
        worker_id=worker_id, agent_nonce="agent-nonce", proof=proofs.proof_for(TOKEN, hello.nonce, worker_id),
        version=version or chunkline_version(), pipeline=pipeline_name(TINY), pipeline_digest=pipeline_digest(TINY),
        node="hostile", devices=(), launcher="external", pid=1))
    with trio.fail_after(HANDSHAKE_TIMEOUT):
        reply = await channel.receive()
    if isinstance(reply, wire.Welcome):
        assert proofs.authority_proof_matches(TOKEN, hello.nonce, "agent-nonce", worker_id, reply.proof), reply
        channel.authenticate(proofs.frame_key(TOKEN, hello.nonce, "agent-nonce", worker_id), authority=False)
    elif isinstance(reply, wire.Refused):
        assert proofs.refusal_proof_matches(TOKEN, hello.nonce, "agent-nonce", worker_id, reply.reason,
                                            reply.transient, reply.proof), reply
    elif isinstance(reply, wire.Busy):
        assert proofs.busy_proof_matches(TOKEN, hello.nonce, "agent-nonce", worker_id, reply.reason, reply.proof), reply
    return channel, reply


async def still_serving(cluster: Cluster, worker_id: str) -> None:
    """The authority takes a well-formed agent after whatever came before, and lists it."""
    channel, reply = await register(cluster, worker_id)
    assert isinstance(reply, wire.Welcome), reply
    await channel.send(wire.Ready(1, "bidirectional", PLAN))
    await until(lambda: any(w["worker_id"] == worker_id for w in cluster.workers()), f"{worker_id} in health", cluster,
                deadline=10)
    await channel.send(wire.Drain(1.0))  # leaves as a drained agent does
    await channel.send(wire.Goodbye("drained"))
    await channel.aclose()


async def closed_by_peer(stream: trio.SocketStream, deadline: float) -> bool:
    """True when the authority closes the connection within ``deadline`` (reading and dropping what it sends)."""
    with trio.move_on_after(deadline):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
        return True
    return False


def losses(cluster: Cluster) -> dict[str, str]:
    return {loss["worker_id"]: loss["cause"] for loss in cluster.get("/v1/service/metadata")["cluster"]["recent_losses"]}


async def say_ready(authority: Cluster, channel: wire.Channel, worker_id: str) -> None:
    """A registered agent reports ready; wait until the authority counts it eligible."""
    await channel.send(wire.Ready(1, "bidirectional", PLAN))
    await until(lambda: any(w["worker_id"] == worker_id and w["state"] in ("idle", "busy") for w in authority.workers()),
                f"agent {worker_id!r} to be ready", authority, deadline=10)


async def sent_before_the_end(channel: wire.Channel, message: wire.Message) -> bool:
    """Send ``message`` as a hostile agent does; False when the authority has ended the connection (closed or
    reset it: a reset is how a peer's close looks while frames it never read are still on their way)."""
    try:
        await channel.send(message)
    except wire.ConnectionClosed:
        return False
    return True


async def heartbeat_until_lost(authority: Cluster, channel: wire.Channel, worker_id: str, give_up: float,
                               *, seq: int = 0) -> None:
    """Heartbeat as a live agent does until the authority loses the worker (or closes it); fail at ``give_up``."""
    while not losses(authority).get(worker_id):
        seq += 1
        if not await sent_before_the_end(channel, wire.Heartbeat(seq, ())):
            break
        await trio.sleep(INTERVAL / 2)  # bench-cost: heartbeats as often as a live agent sends them
        assert time.monotonic() < give_up, f"agent {worker_id!r} was not lost"
    await channel.aclose()
