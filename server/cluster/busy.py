"""The authority turning connections away while as many handshakes are pending as it allows (someone may be
flooding the cluster port): a proven Busy for a bounded number of them at once, each within a short window; the
rest closed unanswered. Split from :mod:`server.cluster.authority`."""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable

import trio

from . import proofs, wire

__all__ = ["BusyAnswers", "MAX_BUSY_ANSWERS", "BUSY_WINDOW"]

log = logging.getLogger("chunkline.cluster")

#: past the pending limit, connections answered Busy at once, at most: each gets a Hello and BUSY_WINDOW seconds
#: to send its Register, so that the Busy can prove the token over the agent's nonce (one HMAC: an agent waits a
#: proven Busy out without counting it, and must not do so for an impostor's). Past this too, a connection is
#: closed unanswered: the places held for unregistered peers stay bounded in number and in time, and an unproven
#: answer would change nothing (an agent counts it as a failed connect either way)
MAX_BUSY_ANSWERS = 32
BUSY_WINDOW = 1.0


class BusyAnswers:
    """The connections turned away, and the Busy answers under way (at most :data:`MAX_BUSY_ANSWERS`)."""

    def __init__(self, *, token: str, version: str, wrap: Callable[[trio.abc.Stream], trio.abc.Stream]) -> None:
        self._token = token
        self._version = version
        self._wrap = wrap  # the listener's TLS, if it has one
        self.shed = 0  # connections told Busy (or closed unanswered)
        self._answering = 0

    async def turn_away(self, stream: trio.abc.Stream, pending: int) -> None:
        """``pending`` handshakes are under way: answer the Register with a proven Busy, within BUSY_WINDOW and for
        MAX_BUSY_ANSWERS connections at once; close the rest unanswered."""
        self.shed += 1
        if self.shed == 1 or self.shed % 1000 == 0:
            log.warning("cluster: %d handshakes pending; turned a connection away busy (%d so far)", pending, self.shed)
        if self._answering >= MAX_BUSY_ANSWERS:
            await stream.aclose()
            return
        self._answering += 1
        channel = wire.Channel(self._wrap(stream), max_frame=wire.MAX_HANDSHAKE_FRAME_BYTES)
        reason = f"{pending} registrations pending; dial again later"
        try:
            with trio.move_on_after(BUSY_WINDOW), contextlib.suppress(wire.ConnectionClosed, wire.WireError):
                nonce = secrets.token_hex(16)
                await channel.send(wire.Hello(nonce, self._version))
                register = await channel.receive()
                if isinstance(register, wire.Register):
                    proof = proofs.busy_proof(self._token, nonce, register.agent_nonce, register.worker_id, reason)
                    await channel.send(wire.Busy(reason, proof))
        finally:
            self._answering -= 1
            await channel.aclose()
