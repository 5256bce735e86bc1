"""``--worker-gpu-map``: each worker's group becomes its visible devices, ``gpu_num`` is the group's size.

A pipeline file written by the test records what its ``get_service`` was given and
what it sees (``CUDA_VISIBLE_DEVICES``) into a file, then serves the replay. Process
workers run it in real child processes; in-process workers in the server's process.
The toy world picks its device from ``gpu_ids``, never from ``gpu_num``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from pipelines import toy_world
from server.process_service import start_process_service

from .conftest import make_settings, serve, wait_until

RECORDING_PIPELINE = '''
import json, os
from pipelines.replay import get_service as replay

def get_service(gpu_num=0, *, gpu_ids=()):
    with open(os.environ["CHUNKLINE_TEST_GPU_RECORD"], "a") as out:
        out.write(json.dumps({"gpu_num": gpu_num, "gpu_ids": list(gpu_ids),
                              "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\\n")
    return replay(gpu_num)
'''


@pytest.mark.parametrize("mode", ["process", "in-process"])
async def test_each_worker_gets_its_group(mode, tmp_path: Path, monkeypatch):
    pipeline = tmp_path / "recording.py"
    pipeline.write_text(RECORDING_PIPELINE)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("CHUNKLINE_TEST_GPU_RECORD", str(record))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    settings = make_settings(pipeline=str(pipeline), num_workers=2, worker_gpu_map="0,1;2", worker_mode=mode,
                             max_sessions_per_worker=1, queue_size=0)
    loader: Any = start_process_service if mode == "process" else None
    if loader is None:
        from pipelines.loader import load_service as loader
    async with serve(settings, loader=loader) as s:
        await wait_until(lambda: s.runtime.book.snapshot().workers_idle == 2, "both workers")
        metadata = (await s.json("get", "/v1/service/metadata"))[1]
        assert metadata["num_workers"] == 2 and metadata["workers_idle"] == 2
    seen = sorted((json.loads(line) for line in record.read_text().splitlines()), key=lambda r: -r["gpu_num"])
    if mode == "process":  # the child sees only its group, renumbered from 0
        assert seen == [{"gpu_num": 2, "gpu_ids": [0, 1], "visible": "0,1"}, {"gpu_num": 1, "gpu_ids": [0], "visible": "2"}]
    else:  # one process: the service is told its devices
        assert seen == [{"gpu_num": 2, "gpu_ids": [0, 1], "visible": None}, {"gpu_num": 1, "gpu_ids": [2], "visible": None}]


@pytest.mark.parametrize(("gpu_ids", "device"), [((), "cpu"), ((0,), "cuda:0"), ((3, 1), "cuda:3")])
def test_the_toy_world_takes_its_device_from_its_group_not_from_gpu_num(gpu_ids, device, monkeypatch):
    monkeypatch.setattr(toy_world, "_cuda_available", lambda: True)  # the choice, on a machine without CUDA
    assert toy_world.group_device(gpu_ids) == device  # a map "0" is cuda:0


def test_gpu_num_alone_selects_no_device():
    assert toy_world.get_service(gpu_num=1, height=32, width=48).config.device == "cpu"  # not cuda:1
