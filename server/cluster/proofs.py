"""What proves the cluster token in the agent <-> authority handshake (:mod:`server.cluster.wire`).

Each side answers the other's fresh nonce with an HMAC-SHA256 under the token: the agent in its
Register, the authority in its Welcome (or Refused, or Busy); both then derive the connection's frame key
from the token and both nonces. The token itself never crosses the wire.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = [
    "proof_for",
    "proof_matches",
    "authority_proof",
    "authority_proof_matches",
    "refusal_proof",
    "refusal_proof_matches",
    "busy_proof",
    "busy_proof_matches",
    "frame_key",
]


def _mac(token: str, label: str, *parts: str) -> bytes:
    """HMAC-SHA256 under the cluster token over a label and length-prefixed parts.

    Every use has its own label, and the parts cannot run into each other, so no proof one side
    makes over the other's nonce can stand in for another proof or for the frame key."""
    message = bytearray(b"chunkline " + label.encode() + b"\0")
    for part in parts:
        data = part.encode()
        message += len(data).to_bytes(4, "big") + data
    return hmac.new(token.encode(), bytes(message), hashlib.sha256).digest()


def proof_for(token: str, nonce: str, worker_id: str) -> str:
    """The agent's proof: it holds the token (over the authority's fresh nonce and its worker id)."""
    return _mac(token, "agent", nonce, worker_id).hex()


def proof_matches(token: str, nonce: str, worker_id: str, proof: str) -> bool:
    return hmac.compare_digest(proof_for(token, nonce, worker_id), proof)


def authority_proof(token: str, nonce: str, agent_nonce: str, worker_id: str) -> str:
    """The authority's proof in its Welcome: it holds the token (over the agent's fresh nonce too)."""
    return _mac(token, "authority", nonce, agent_nonce, worker_id).hex()


def authority_proof_matches(token: str, nonce: str, agent_nonce: str, worker_id: str, proof: str) -> bool:
    return hmac.compare_digest(authority_proof(token, nonce, agent_nonce, worker_id), proof)


def refusal_proof(token: str, nonce: str, agent_nonce: str, worker_id: str, reason: str, transient: bool) -> str:
    """The authority's proof in a Refused: this refusal, of this registration, and whether it is transient (the
    agent dials again) or not (it exits), comes from a token holder."""
    return _mac(token, "refusal", nonce, agent_nonce, worker_id, reason, "transient" if transient else "final").hex()


def refusal_proof_matches(token: str, nonce: str, agent_nonce: str, worker_id: str, reason: str, transient: bool,
                          proof: str | None) -> bool:
    return proof is not None and hmac.compare_digest(
        refusal_proof(token, nonce, agent_nonce, worker_id, reason, transient), proof)


def busy_proof(token: str, nonce: str, agent_nonce: str, worker_id: str, reason: str) -> str:
    """The authority's proof in a Busy: a token holder, at the pending-handshake limit, turned this dial away."""
    return _mac(token, "busy", nonce, agent_nonce, worker_id, reason).hex()


def busy_proof_matches(token: str, nonce: str, agent_nonce: str, worker_id: str, reason: str,
                       proof: str | None) -> bool:
    return proof is not None and hmac.compare_digest(busy_proof(token, nonce, agent_nonce, worker_id, reason), proof)


def frame_key(token: str, nonce: str, agent_nonce: str, worker_id: str) -> bytes:
    """The key of one connection's frame tags (:meth:`Channel.authenticate`), fresh with every handshake."""
    return _mac(token, "frames", nonce, agent_nonce, worker_id)
