"""``chunkline stream-serve`` with a pipeline that can never load, met as a user meets it: a real process, its log,
health and a create over HTTP, then SIGTERM.

A load that fails the way the slot's last load failed, while no worker of the slot ever loaded, ends the slot's
restarts: it was retried five times with backoff (about 30 s), a full traceback each time, while health counted
every failed worker once more (``workers_total`` 1, 2, 3... for one slot). Now the server says it once, in one line
naming the pipeline and the error (the traceback once), keeps serving with health saying why, answers a create
with a 503 that says why and no Retry-After (nothing will come), and ends on SIGTERM as ever (exit 0).
A worker that loaded and then crashed is still replaced with backoff (``spec_tests/reliability/test_worker_restarts.py``).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from .served_process import START_DEADLINE, stream_serve

BROKEN = {
    "import": ("raise FileNotFoundError('weights.pt not found')\n", "FileNotFoundError: weights.pt not found"),
    "get_service": ("def get_service(**offered):\n    raise KeyError('denoise')\n", "KeyError: 'denoise'"),
}
COUNTED = ("starting", "idle", "busy", "draining", "failed", "stopped")


async def slot_settled(client: httpx.AsyncClient) -> dict[str, Any]:
    """Health once the only slot is no longer running nor backing off (it gave up)."""
    with trio.fail_after(START_DEADLINE):
        while (health := (await client.get("/v1/service/health")).json())["worker_slots"]["worker-0"]["state"] in (
                "running", "backing_off"):
            await trio.sleep(0.05)  # bench-cost: the subprocess loads its pipeline, then its replacement
    return health


@pytest.mark.parametrize(("where", "mode"), [("import", "in-process"), ("get_service", "in-process"),
                                           ("get_service", "process")])
async def test_a_pipeline_that_cannot_load_is_told_once_and_health_says_why(short_tmp: Path, where: str,
                                                                           mode: str) -> None:
    """In a process worker's child too: each child's failure names its own service (``process-service-2``), and
    what is compared is the child's own error."""
    source, error = BROKEN[where]
    pipeline = short_tmp / "broken_pipeline.py"
    pipeline.write_text(source)
    async with stream_serve(short_tmp, "--worker-mode", mode, pipeline=str(pipeline)) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:
            health = await slot_settled(client)
            slot = health["worker_slots"]["worker-0"]
            assert slot["state"] == "gave_up" and slot["restarts"] == 1, slot
            assert slot["reason"].startswith("the pipeline never loaded: it failed the same way twice in a row")
            assert error in slot["reason"] and slot["reason"].endswith("not restarted"), slot
            assert health["status"] == "unhealthy" and health["ready"] is False
            # one slot, one worker: the worker it replaced is history, not a second failed worker
            assert health["workers_total"] == 1 == health["workers_failed"], health
            assert health["workers_total"] == sum(health[f"workers_{state}"] for state in COUNTED), health
            assert [w["worker_id"] for w in health["workers"]] == ["worker-0.1"], health["workers"]
            assert slot["replaced"]["worker_id"] == "worker-0" and error in slot["replaced"]["failure"], slot
            response = await client.post("/v1/stream/sessions", json={"identity": "ctl"})
            assert response.status_code == 503 and response.json()["error"] == "no_worker", response.text
            assert error in response.json()["detail"] and "Retry-After" not in response.headers, response.headers
        await served.read_until(b"not restarted")
        served.process.send_signal(signal.SIGTERM)
        assert await served.exit_code() == 0, served.text()
        assert served.process.stderr is not None
        with trio.fail_after(START_DEADLINE):  # what it wrote before it exited, up to the end of its stderr
            while data := await served.process.stderr.receive_some():
                served.log += data
    log = served.log.decode(errors="replace")
    assert log.count(f"\n{error}\n") == 1, log  # the error's traceback, once
    (gave_up,) = [line for line in log.splitlines() if "not restarted" in line]
    assert f"worker slot worker-0, pipeline {str(pipeline)!r}: the pipeline never loaded" in gave_up, gave_up
    assert "ERROR" in gave_up and error in gave_up
