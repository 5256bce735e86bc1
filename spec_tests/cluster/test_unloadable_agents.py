"""``chunkline stream-serve --workers local`` with a pipeline that can never load, met as a user meets it: a real
authority, its real agents, health and a create over HTTP (``--workers ray``: ``test_ray.py`` runs the same check).

An agent whose pipeline raises in ``get_service()`` exits before it ever registers; its launcher replaced it with
backoff up to the crash-loop limit (5 restarts, about 30 s), each agent's traceback in the log and each restart's
line saying "restart N of 5". As in-process worker slots do, a slot whose agents never loaded and failed the same way
twice is not started again: one line names the pipeline and the error, health's ``worker_slots`` (``local-0``) says
why, and a create's 503 carries no Retry-After (nothing will come: the launcher made the only token, and its only
slot gave up).
"""

from __future__ import annotations

from pathlib import Path

import httpx

from .conftest import Cluster, start_authority, until

ERROR = "KeyError: 'denoise'"


def broken_pipeline(folder: Path) -> Path:
    pipeline = folder / "broken_pipeline.py"
    pipeline.write_text("def get_service(**offered):\n    raise KeyError('denoise')\n")
    return pipeline


async def told_once(cluster: Cluster, slot_name: str, pipeline: Path, *, exits_cleanly: bool = True) -> None:
    """The slot gave up after its second agent failed as its first, health and a create say so, and the log says it
    in one line (and the error's traceback once); then the authority stops (cleanly, unless ``exits_cleanly`` is
    False: under Ray the driver's own SIGTERM handler may end it by the signal, as test_ray.py's authority may)."""
    try:
        await until(lambda: b"not restarted" in cluster.process.raw, "the slot to give up", cluster)
        health = cluster.get("/v1/service/health")
        slot = health["worker_slots"][slot_name]
        assert slot["state"] == "gave_up" and slot["restarts"] == 1, slot
        assert slot["reason"].startswith("the pipeline never loaded: it failed the same way twice in a row"), slot
        assert ERROR in slot["reason"], slot
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
            response = await client.post("/v1/stream/sessions", json={"identity": "ctl"})
        assert response.status_code == 503 and response.json()["error"] == "no_worker", response.text
        assert "Retry-After" not in response.headers, response.headers
    finally:
        if exits_cleanly:
            cluster.stop()
        else:
            cluster.http.close()
            cluster.process.stop()
    log = cluster.process.text(tail=10 ** 6)
    (gave_up,) = [line for line in log.splitlines() if "not restarted" in line]
    launcher, number = slot_name.split("-")
    assert f"{launcher} slot {number}, pipeline {str(pipeline)!r}: the pipeline never loaded" in gave_up, gave_up
    assert "ERROR" in gave_up and ERROR in gave_up, gave_up
    assert "a repeat of the same load failure ends it" in log, log  # the first restart's line says what comes
    # the error's traceback, once (under Ray each of the actor's lines starts with its name and pid, in colour)
    assert [line.rsplit("\x1b[0m ", 1)[-1] for line in log.splitlines()].count(ERROR) == 1, log


async def test_an_agent_whose_pipeline_never_loads_is_started_twice_and_told_once(tmp_path: Path) -> None:
    pipeline = broken_pipeline(tmp_path)
    await told_once(start_authority(launcher="local", workers=1, pipeline=str(pipeline), token=None), "local-0",
                    pipeline)
