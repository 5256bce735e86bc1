"""An agent's dial: connect, the authority's hello, the agent's register, the authority's answer.

Split from :mod:`server.cluster.agent` (which registers, serves and leaves). A stop signal before the register
goes out ends the dial there (:data:`~server.cluster.dial_ends.End.STOPPED`): an agent told to stop while it
dials never registers. After the register went out the authority may hold it already; the answer is awaited
(bounded) and the agent leaves without saying ready (:mod:`states.agent`).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import attrs
import trio

from ..log_pace import LogPace
from . import proofs, tls, wire
from .dial_ends import End, Ended, answer, unproven_busy
from .identity import pipeline_digest, pipeline_name

if TYPE_CHECKING:
    import ssl

    from .agent_options import AgentOptions

__all__ = ["CONNECT_TIMEOUT", "Shaken", "handshake"]

log = logging.getLogger("chunkline.agent")

CONNECT_TIMEOUT = 10.0


@attrs.frozen
class Shaken:
    """A registration the authority took, its token proven: the channel (tagging frames), its welcome, and when the
    register went out (the authority's heartbeat deadline starts when it arrives)."""

    channel: wire.Channel
    welcome: wire.Welcome
    sent_at: float


async def handshake(options: AgentOptions, address: tuple[str, str, int], client_tls: ssl.SSLContext | None,
                    worker_id: str, stoppable: Callable[[], AbstractContextManager[trio.CancelScope]], *,
                    proven: bool = False, unproven: LogPace | None = None) -> Shaken | Ended:
    """One dial of ``address`` (scheme, host, port) registering ``worker_id``. ``stoppable()`` is a cancel scope that
    a stop signal cancels: it covers everything before the register. ``proven``: this agent registered at this
    address before, so an authority is there (one that says nothing has stalled, it is no other service).
    ``unproven`` paces the line of a refusal nobody proved (:func:`~server.cluster.dial_ends.answer`)."""
    scheme, host, port = address
    agent_nonce = secrets.token_hex(16)
    channel: wire.Channel | None = None
    hello: wire.Message | None = None
    try:
        with trio.fail_after(CONNECT_TIMEOUT):
            with stoppable() as stop:
                stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
                if client_tls is not None:
                    stream = tls.wrap_client_tls(stream, host, client_tls)
                # small frames until the peer proved the token: an impostor cannot make this side buffer 16 MiB
                channel = wire.Channel(stream, max_frame=wire.MAX_HANDSHAKE_FRAME_BYTES)
                hello = await channel.receive()
            if stop.cancel_called:  # no checkpoint from here to the register: a stop now comes after it went out
                if channel is not None:
                    await channel.aclose()
                return Ended(End.STOPPED, "a stop signal came before the register went out")
            assert hello is not None
            if isinstance(hello, wire.Busy):  # in place of the hello: over no nonce of ours, it proves nothing
                await channel.aclose()  # type: ignore[union-attr]
                return unproven_busy(options.authority, hello)
            if not isinstance(hello, wire.Hello):
                raise wire.WireError(f"expected hello, got {hello.TYPE}")
            sent_at = trio.current_time()
            await channel.send(  # type: ignore[union-attr]
                wire.Register(
                    worker_id=worker_id,
                    agent_nonce=agent_nonce,
                    proof=proofs.proof_for(options.token, hello.nonce, worker_id),
                    version=options.version,
                    pipeline=pipeline_name(options.pipeline),
                    pipeline_digest=pipeline_digest(options.pipeline),
                    node=options.node,
                    devices=options.devices,
                    launcher=options.launcher,
                    pid=os.getpid(),
                    slot=options.slot,
                )
            )
            reply = await channel.receive()  # type: ignore[union-attr]
    except wire.ProtocolMismatch as exc:  # unproven, as every frame before the proofs: a crash loop of them exits 3
        if channel is not None:
            await channel.aclose()
        log.error("%s speaks another wire protocol: %s", options.authority, exc)
        return Ended(End.UNPROVEN_REFUSAL, f"another wire protocol: {exc}")
    except (OSError, trio.TooSlowError, wire.ConnectionClosed, wire.WireError) as exc:
        detail = str(exc)  # trio.TooSlowError says nothing: its name alone, not "TooSlowError: "
        why = f"authority unreachable: {type(exc).__name__}{': ' + detail if detail else ''}"
        if channel is None:  # no connection at all (refused, no route, no answer): it may be restarting
            return Ended(End.UNREACHABLE, why)
        await channel.aclose()
        if hello is None:
            return _no_hello(exc, why, scheme, proven)
        return Ended(End.LOST, why)
    ended = answer(reply, token=options.token, at=options.authority, nonce=hello.nonce, agent_nonce=agent_nonce,
                   worker_id=worker_id, unproven=unproven)
    if ended is not None:
        await channel.aclose()
        return ended
    assert isinstance(reply, wire.Welcome)
    channel.max_frame = wire.MAX_FRAME_BYTES
    channel.authenticate(proofs.frame_key(options.token, hello.nonce, agent_nonce, worker_id), authority=False)
    return Shaken(channel, reply, sent_at)


def _no_hello(exc: Exception, why: str, scheme: str, proven: bool) -> Ended:
    """How a dial ended that connected but never got the authority's hello."""
    if isinstance(exc, wire.TlsFailed):  # no TLS there, or a certificate --tls-ca does not vouch for
        if exc.untrusted:  # (it asked whether this was the --cluster-port, of a port that spoke TLS)
            return Ended(End.NOT_AN_AUTHORITY, f"{exc} (the authority's certificate is not one --tls-ca trusts)")
        return Ended(End.NOT_AN_AUTHORITY, f"{exc} (no TLS there: a plain cluster port, dialed tcp://, or not the "
                                           f"--cluster-port)")
    if isinstance(exc, wire.ConnectionClosed):
        # closed without a word: an authority turning connections away (a flood past its busy answers) or
        # going down; counted, a flood by anyone at all made every dial count and the agent give up in 20 s
        return Ended(End.UNREACHABLE, f"it closed the connection before its hello ({exc})")
    if isinstance(exc, trio.TooSlowError) and proven:  # its kernel still takes connections: stopped (SIGSTOP), its
        # event loop held: dialed again as an unreachable one is, uncounted; it was named "not a chunkline authority
        # (is this the --cluster-port?)", and after 60 s the agent gave up for good (exit 3: not replaced)
        return Ended(End.UNREACHABLE, f"it took the connection but sent no hello within {CONNECT_TIMEOUT:g} s: the "
                                      "authority this agent registered with has stalled (stopped, or its event loop "
                                      "held)")
    if isinstance(exc, trio.TooSlowError):  # connected, and then nothing: not an authority at all
        tls = "; a TLS port? dial tls://" if scheme == "tcp" else ""
        return Ended(End.NOT_AN_AUTHORITY, f"no hello within {CONNECT_TIMEOUT:g} s (is this the --cluster-port, not "
                                           f"the HTTP port?{tls})")
    if isinstance(exc, wire.WireError):  # bytes that are not a frame
        return Ended(End.NOT_AN_AUTHORITY, f"{exc} (is this the --cluster-port, not the HTTP port?)")
    return Ended(End.LOST, why)
