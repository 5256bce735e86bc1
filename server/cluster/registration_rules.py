"""Which registrations the authority takes: the rules a Register must pass before a worker joins the directory.

A peer that proves the cluster token may still be refused: another chunkline version, pipeline or pipeline code, an
identity that cannot name a room participant, an agent its launcher did not start (for good: the agent exits 3), or,
for now (the agent dials again, uncounted), a worker id that is taken or a directory at its limit. The reason goes to
the agent inside a proof (:mod:`server.cluster.proofs`), so only the token holder can refuse it for good.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from ..reasons import echo
from ..tokens import IdentityError, validate_identity
from . import proofs, wire
from .identity import worker_participant

if TYPE_CHECKING:
    from .authority import ClusterAuthority

__all__ = ["Refusal", "refusal", "REGISTERED_PER_EXPECTED", "MIN_REGISTERED"]

#: registered workers the authority holds at most: this many per expected worker (``--num-workers``, or the
#: launcher's slots), and never fewer than MIN_REGISTERED. Room for replacements and scale-out past the expected
#: count, but a token holder cannot make it hold workers (records, connections, frame buffers) without end;
#: past it a registration is refused for now (the agent dials again). Handshakes pending at once
#: (MAX_PENDING_HANDSHAKES) may pass the count together, so it can be exceeded by that many at most.
REGISTERED_PER_EXPECTED = 4
MIN_REGISTERED = 16


@attrs.frozen
class Refusal:
    """Why a registration is refused, and whether the same agent may be taken later (``transient``: it dials
    again, not counting it toward giving up) or never (it exits 3). The agent reads both off the wire, proven."""

    reason: str
    transient: bool = False


def refusal(authority: ClusterAuthority, message: wire.Message, nonce: str) -> Refusal | None:
    """Why a first frame is refused; every reason but a taken id or a full directory is for good (the agent would send
    it again)."""
    if not isinstance(message, wire.Register):
        return Refusal(f"expected register, got {message.TYPE}")
    if not proofs.proof_matches(authority.token, nonce, message.worker_id, message.proof):
        return Refusal("the cluster token does not match")
    try:
        validate_identity(message.worker_id)
        validate_identity(worker_participant(message.worker_id))  # the identity it joins its rooms as
    except IdentityError as exc:
        return Refusal(f"worker id {echo(message.worker_id)} cannot name a room participant: {exc}")
    if message.version != authority.version:
        return Refusal(f"chunkline version {echo(message.version)} differs from the authority's {authority.version!r}")
    if message.pipeline != authority.pipeline:
        return Refusal(f"pipeline {echo(message.pipeline)} differs from the authority's {authority.pipeline!r}")
    if message.pipeline_digest != authority.digest:
        return Refusal(f"pipeline {echo(message.pipeline)} has other code (digest {echo(message.pipeline_digest)}, "
                       f"authority {authority.digest!r})")
    if authority.launcher is not None:
        stranger = authority.launcher.refusal(message)
        if stranger is not None:
            return Refusal(stranger)
    if len(authority.handles) >= authority.max_registered:
        return Refusal(f"the authority holds {len(authority.handles)} workers, its limit ({REGISTERED_PER_EXPECTED} per "
                       f"expected worker, at least {MIN_REGISTERED}); try again once one has left", transient=True)
    if message.worker_id in authority.liveness:  # the agent dials again under a fresh id
        return Refusal(f"worker id {echo(message.worker_id)} is taken; an agent takes a fresh id every dial",
                       transient=True)
    return None
