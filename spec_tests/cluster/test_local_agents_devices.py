"""``--workers local`` without ``--worker-gpu-map`` hands its agents no GPU, as an in-process worker has none.

Each agent was started with ``--devices 0`` and ``CUDA_VISIBLE_DEVICES=0``, its pipeline's ``get_service`` called with
``gpu_num=1``, and health listed every worker on GPU 0 (while the server refuses ``--worker-gpu-map 0`` on a host with
no GPU): on a GPU host every local agent would have piled onto GPU 0. Through a real ``chunkline stream-serve`` and
its real agent processes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from ..reliability.test_held_loop_stops import Server
from ..server.http_served import AGENT_START

NOTING_WORLD = """\
import os

from spec_tests.cluster.tiny_world import get_service as tiny_world


def get_service(gpu_num=0, **options):
    with open(os.environ["NOTING_WORLD_NOTES"], "a") as notes:
        notes.write(f"{gpu_num} {os.environ.get('CUDA_VISIBLE_DEVICES')!r}\\n")
    return tiny_world(gpu_num, **options)
"""


def test_local_agents_without_a_gpu_map_get_no_gpu(tmp_path: Path) -> None:
    pipeline = tmp_path / "noting_world.py"
    pipeline.write_text(NOTING_WORLD)
    notes = tmp_path / "notes.txt"
    os.environ["NOTING_WORLD_NOTES"] = str(notes)  # the server's environment, and so its agents'
    visible = os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # the server's own view: every GPU, or none here
    server = Server(["-m", "server.cli", "stream-serve", str(pipeline), "--port", "0", "--workers", "local",
                     "--num-workers", "2"])
    try:
        url = server.ready()  # the first agent is in; the second may still be loading
        deadline = time.monotonic() + AGENT_START
        while len((health := httpx.get(f"{url}/v1/service/health", timeout=30).json())["workers"]) < 2:
            assert time.monotonic() < deadline, health
            time.sleep(0.2)  # bench-cost: another process's agent loading, polled as a client would
        assert [worker["devices"] for worker in health["workers"]] == [[], []], health["workers"]
        assert notes.read_text().splitlines() == ["0 None", "0 None"], notes.read_text()
        assert "--devices names GPU" not in server.log.decode(errors="replace")
    finally:
        server.end()
        del os.environ["NOTING_WORLD_NOTES"]
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


def test_what_a_killed_local_authority_left_on_disk_goes_with_the_next_one(tmp_path: Path) -> None:
    """The local launcher's folder (where its agents tell a failed load) was named by no process id: a SIGKILLed
    authority's stayed for good (112 of them had gathered on one host). The next server removes it, as it removes a
    killed server's other folders."""
    pipeline = tmp_path / "noting_world.py"
    pipeline.write_text(NOTING_WORLD)
    # the servers' temporary directory, and their agents': short (pytest's own is too long for the front's socket)
    temporary = Path(tempfile.mkdtemp(prefix="cl-"))
    os.environ["NOTING_WORLD_NOTES"] = str(tmp_path / "notes.txt")
    os.environ["TMPDIR"] = str(temporary)
    try:
        for _ in range(2):
            server = Server(["-m", "server.cli", "stream-serve", str(pipeline), "--port", "0", "--workers", "local"])
            try:
                server.ready()
                folders = sorted(path.name for path in temporary.glob("chunkline-launcher-*"))
                assert len(folders) == 1 and folders[0].startswith(f"chunkline-launcher-{server.popen.pid}-"), folders
            finally:
                server.end()  # a SIGKILL: nothing of the server's runs
    finally:
        del os.environ["NOTING_WORLD_NOTES"], os.environ["TMPDIR"]
        shutil.rmtree(temporary, ignore_errors=True)
