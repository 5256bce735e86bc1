"""The authority's ``--max-sessions-per-worker`` holds for every agent. A local or Ray agent is started with it;
an external agent is started by someone else and reports its own plan's capacity, which the authority takes up to
that limit: it took the agent's word, and placed up to 64 sessions on an agent while its metadata said 1."""

from __future__ import annotations

import logging

log = logging.getLogger("chunkline.cluster")


def admitted_capacity(reported: int, limit: int | str, worker_id: str) -> int:
    """The sessions the authority places on an agent that reported ``reported``: at most ``limit`` (``auto``: no
    limit of the authority's own)."""
    if not isinstance(limit, int) or reported <= limit:
        return reported
    log.info("cluster: worker %s reports capacity %d; --max-sessions-per-worker holds it to %d",
             worker_id, reported, limit)
    return limit
