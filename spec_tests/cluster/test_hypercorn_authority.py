"""An authority deployed as ``hypercorn server:app`` (no ``chunkline stream-serve`` to tell it where it listens):
its agents must still join. They were refused for good ("the authority does not know its rooms URL yet"): only
stream-serve said where the server was bound, so under hypercorn every registration was refused while health
said the workers were starting. With ``CHUNKLINE_PUBLIC_URL`` the agents join before any request; without it,
the first request's own address (its socket's, not its Host header) is where they join the local rooms, and a dial
before it is refused for now, in words (it waited for the URL past the agent's own deadline for the hello)."""

from __future__ import annotations

import re
import sys

import httpx
import pytest

from .conftest import DEADLINE, INTERVAL, TINY, TOKEN, Process, clean_env, free_port, until

#: hypercorn's line naming where it listens (the port it took, where it was given 0)
RUNNING = re.compile(rb"Running on (http://127\.0\.0\.1:\d+) ")


@pytest.mark.parametrize("public_url", [False, True], ids=["first-request", "public-url"])
async def test_a_hypercorn_authority_takes_its_local_agents(public_url: bool) -> None:
    # hypercorn's own pick (0), read from its log; but a public URL names the port before hypercorn binds it: only
    # then is it chosen here (free now, not held: another process may take it first)
    port = free_port() if public_url else 0
    # the cluster port is the authority's own pick: it tells its local agents which it took
    env = clean_env(CHUNKLINE_PIPELINE=TINY, CHUNKLINE_WORKERS="local", CHUNKLINE_NUM_WORKERS="1",
                    CHUNKLINE_CLUSTER_PORT="0", CHUNKLINE_CLUSTER_TOKEN=TOKEN,
                    CHUNKLINE_HEARTBEAT_INTERVAL=str(INTERVAL), CHUNKLINE_HEARTBEAT_DEADLINE=str(DEADLINE))
    if public_url:
        env["CHUNKLINE_PUBLIC_URL"] = f"http://127.0.0.1:{port}"
    authority = Process([sys.executable, "-m", "hypercorn", "--worker-class", "trio", "--bind", f"127.0.0.1:{port}",
                         "server:app"], env)
    try:
        running = await until(lambda: RUNNING.search(authority.raw), "hypercorn to say where it listens", None)
        base_url = running.group(1).decode()
        assert not public_url or base_url == env["CHUNKLINE_PUBLIC_URL"], base_url
        if public_url:  # registered before any request came in
            await until(lambda: b"registered" in authority.raw, "the agent's registration", None)
        else:  # before any request its dials are refused for now, in words (they waited out the agent's hello deadline)
            await until(lambda: b"does not know its rooms URL yet" in authority.raw, "a refusal for now", None)
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:

            async def an_idle_agent() -> bool:
                try:
                    health = (await client.get("/v1/stream/health")).json()
                except httpx.TransportError:  # hypercorn is still starting
                    return False
                return any(worker["state"] == "idle" for worker in health["workers"])

            try:
                await until(an_idle_agent, "an idle agent")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{authority.text()}") from None
            created = await client.post("/v1/stream/sessions", json={"identity": "alice"})
            assert created.status_code == 200 and created.json()["status"] == "assigned", created.text
    finally:
        assert authority.stop() == 0, authority.text()
