"""A controller's token lasts as long as its session may (``--session-timeout`` from the create), not only
``--token-ttl``: a controller has no way to ask for another token.

With ``--token-ttl`` under ``--session-timeout`` (600 s and the default 30 min), a controller whose connection
dropped after the TTL was refused ``expired`` ("ask for a new one", which no route gives a controller), and its
session failed ``controller_left``; a session that waited in the queue past the TTL could not be joined at all and
failed ``controller_absent``. Viewer tokens keep the TTL: a viewer asks for another whenever it likes. Through HTTP:
the tokens a create and a viewer-token request answer, read as LiveKit and the local rooms read them (``exp``).
"""

from __future__ import annotations

import time
from typing import Any

import jwt

from .runner_fixtures import CounterService, serve, settings

TTL = 600.0
SESSION_TIMEOUT = 7200.0


def lifetime(token: str, since: float) -> float:
    """Seconds from ``since`` (wall clock) to the token's expiry, as a verifier reads it."""
    return float(jwt.decode(token, options={"verify_signature": False})["exp"]) - since


async def test_the_controllers_token_lasts_its_sessions_life_and_a_viewers_the_ttl(autojump_clock: Any) -> None:
    service = CounterService(fps=4, frames_per_chunk=1, size=(8, 8))
    chosen = settings(max_sessions_per_worker=1, queue_size=1, token_ttl=TTL, session_timeout=SESSION_TIMEOUT)
    async with serve(chosen, service) as served:
        before = time.time()
        running = await served.create("alice")
        queued = await served.create("bob")
        assert (await served.get(queued["session_id"]))["status"] == "queued"
        for created in (running, queued):
            assert SESSION_TIMEOUT - 5 <= lifetime(created["token"], before) <= SESSION_TIMEOUT + 5, created
            assert served.runtime.issuer.verify(created["token"], room=created["room"]).role == "controller"
        viewer = await served.viewer_token(running["session_id"], "watcher")
        assert TTL - 5 <= lifetime(viewer, before) <= TTL + 5

    async with serve(settings(token_ttl=TTL, session_timeout=60.0), service) as served:  # a short session: the TTL
        before = time.time()
        assert TTL - 5 <= lifetime((await served.create("carol"))["token"], before) <= TTL + 5
