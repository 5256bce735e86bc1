"""``--worker-gpu-map``: each worker's group becomes its visible devices, ``gpu_num`` is the group's size; a map
or an agent's ``--devices`` naming a GPU its process cannot use exits 2 naming it.

A pipeline file written by the test records what its ``get_service`` was given and
what it sees (``CUDA_VISIBLE_DEVICES``) into a file, then serves the replay. Process
workers run it in real child processes; in-process workers in the server's process.
The toy world picks its device from ``gpu_ids``, never from ``gpu_num``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipelines import toy_world
from server import build_app_from_environment
from server.cluster.agent import Agent, AgentOptions
from server.gpu_devices import agent_devices
from server.process_service import start_process_service
from server.setting_values import SettingsError

from .conftest import make_settings, serve, wait_until

ROOT = Path(__file__).resolve().parents[2]
START_DEADLINE = 120.0  # wall seconds for the command to import and give up

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


@pytest.mark.parametrize(("parent", "gpu_map", "process_sees", "in_process_gets"), [
    ("4,5,6", "1,2;0", ["5,6", "4"], [[1, 2], [0]]),
    ("GPU-aa,GPU-bb", "1;0", ["GPU-bb", "GPU-aa"], [[1], [0]]),
])
@pytest.mark.parametrize("mode", ["process", "in-process"])
async def test_a_group_names_gpus_as_the_server_sees_them_under_its_own_cuda_visible_devices(
        mode, parent, gpu_map, process_sees, in_process_gets, tmp_path: Path, monkeypatch):
    """A server given ``CUDA_VISIBLE_DEVICES=4,5,6`` numbers those GPUs 0-2, as its in-process workers do (``cuda:1``
    is the host's GPU 5): a process worker of group ``1,2`` sees the host's GPUs 5 and 6. (It saw ``1,2``: other
    GPUs than an in-process worker of the same map used.)"""
    pipeline = tmp_path / "recording.py"
    pipeline.write_text(RECORDING_PIPELINE)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("CHUNKLINE_TEST_GPU_RECORD", str(record))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent)
    settings = make_settings(pipeline=str(pipeline), num_workers=2, worker_gpu_map=gpu_map, worker_mode=mode,
                             max_sessions_per_worker=1, queue_size=0)
    loader: Any = start_process_service if mode == "process" else None
    if loader is None:
        from pipelines.loader import load_service as loader
    async with serve(settings, loader=loader) as s:
        await wait_until(lambda: s.runtime.book.snapshot().workers_idle == 2, "both workers")
    seen = [json.loads(line) for line in record.read_text().splitlines()]  # (the workers load in either order)
    groups = [[int(gpu) for gpu in group.split(",")] for group in gpu_map.split(";")]
    if mode == "process":
        assert sorted(r["visible"] for r in seen) == sorted(process_sees)
        assert sorted(r["gpu_ids"] for r in seen) == sorted(list(range(len(g))) for g in groups)
    else:
        assert sorted(r["gpu_ids"] for r in seen) == sorted(in_process_gets) and {r["visible"] for r in seen} == {parent}


@pytest.mark.parametrize(("environment", "devices", "ordinals"), [
    ({"CUDA_VISIBLE_DEVICES": "5,7"}, (5, 7), (0, 1)),  # as its launcher starts it: the group, and its ids
    ({"CUDA_VISIBLE_DEVICES": "3"}, (3,), (0,)),
    ({"CUDA_VISIBLE_DEVICES": "5,7"}, (1,), (1,)),  # ids it does not list: the agent's own numbering
    ({}, (2,), (2,)),
])
def test_an_agent_hands_its_service_the_gpu_numbers_of_its_own_process(environment, devices, ordinals, monkeypatch):
    """The local and Ray launchers start an agent with ``CUDA_VISIBLE_DEVICES`` set to its group and ``--devices``
    naming the same GPUs; the agent sees them as 0..n-1. Its in-process service was handed the ids themselves:
    the second agent of ``--worker-gpu-map '0;1'`` loaded on ``cuda:1``, which its process does not have."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    agent = Agent(AgentOptions(pipeline="pipelines/replay", authority="tcp://127.0.0.1:9", token="t" * 32,
                               devices=devices))
    assert agent.worker.gpu_ids == ordinals


def test_the_local_launcher_gives_an_agent_its_group_under_the_servers_own_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert agent_devices((2, 0)) == ("6,4", (6, 4))  # the agent finds its --devices in its CUDA_VISIBLE_DEVICES
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,GPU-bb")
    assert agent_devices((1,)) == ("GPU-bb", (0,))  # named by UUID: the agent's own GPU 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert agent_devices((1, 3)) == ("1,3", (1, 3))


def _absent_gpu() -> int:
    import torch

    return torch.cuda.device_count()  # the first id this host does not have (0 without CUDA, as in CI)


def _run(*words: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_") and k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.run([sys.executable, "-m", "server.cli", *words], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=START_DEADLINE)


@pytest.mark.parametrize("workers", ["in-process", "local"])
def test_a_map_naming_a_gpu_this_host_does_not_have_exits_2_naming_it(workers: str, tmp_path: Path) -> None:
    """On a host without that GPU (without CUDA at all here) the map was taken without a word: every worker ran on
    the CPU (or, with GPUs, died loading on an invalid device ordinal)."""
    gpu = _absent_gpu()
    done = _run("stream-serve", "pipelines/replay", "--port", "0", "--workers", workers, "--num-workers", "2",
                "--worker-gpu-map", f"0;{gpu}" if gpu else "0;1", TMPDIR=str(tmp_path),
                CHUNKLINE_CLUSTER_TOKEN="a-cluster-token-of-16+")
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"chunkline stream-serve: error: --worker-gpu-map names GPU{'' if gpu else 's 0,'} {gpu or 1}, ")
    assert f"torch.cuda.device_count() is {gpu}" in line
    assert list(tmp_path.iterdir()) == []  # nothing started


def test_a_map_from_the_environment_is_checked_under_plain_hypercorn_too() -> None:
    gpu = _absent_gpu()
    with pytest.raises(SettingsError, match=rf"names GPU {gpu}, .*\(from environment variable CHUNKLINE_WORKER_GPU_MAP\)"):
        build_app_from_environment({"CHUNKLINE_PIPELINE": "pipelines/replay", "CHUNKLINE_WORKER_GPU_MAP": str(gpu)})


def test_an_agents_devices_naming_a_gpu_its_host_does_not_have_exit_2() -> None:
    gpu = _absent_gpu()
    done = _run("worker", "pipelines/replay", "--authority", "tcp://127.0.0.1:9", "--devices", str(gpu),
                CHUNKLINE_CLUSTER_TOKEN="a-cluster-token-of-16+", CUDA_VISIBLE_DEVICES=",".join(map(str, range(gpu + 1))))
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"chunkline worker: error: --devices names GPU {gpu}, " in done.stderr
