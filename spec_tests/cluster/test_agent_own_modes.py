"""Metadata shows an external agent's own ``worker_mode`` and configured session limit, not the authority's.

An external agent is started with its own ``chunkline worker`` flags; metadata showed the authority's
``--worker-mode`` and ``--max-sessions-per-worker`` for it (``worker_mode``, ``configured_max_sessions_per_worker``).
Its Ready says its own (its capacity plan carried the limit already; the wire's version 10 adds the mode): each worker
entry shows them, and the top-level values are the agents' when they agree. The authority's limit, when a number,
still holds every agent (``test_external_capacity.py``): the limit shown is the lower of the two. A real authority and an
external agent.
"""

from __future__ import annotations

from .conftest import external_agent


async def test_an_external_agent_is_shown_with_its_own_worker_mode_and_session_limit() -> None:
    # the authority's own limit, which it would give workers it started: another than the agent's (its
    # --worker-mode is refused with external agents, which run with their own)
    authority_args = ("--max-sessions-per-worker", "auto")
    async with external_agent(*authority_args, agent_args=("--max-sessions", "2")) as (authority, _):
        [worker] = authority.eligible()
        metadata = authority.get("/v1/service/metadata")
        assert metadata["worker_mode"] == "in-process", metadata
        assert metadata["configured_max_sessions_per_worker"] == 2, metadata
        assert (worker["worker_mode"], worker["configured_max_sessions"]) == ("in-process", 2), worker
        assert metadata["max_sessions_per_worker"] == 2, metadata
        [shown] = metadata["workers"]
        assert (shown["worker_mode"], shown["configured_max_sessions"]) == ("in-process", 2), shown
