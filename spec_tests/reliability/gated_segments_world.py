"""The gated tiny toy world (``spec_tests/cluster/gated_world.py``) holding a tensor channel while it loads: its
shared memory is in /dev/shm (``cl_<pid>-*``) from the moment ``$GATED_WORLD/loading`` exists until the load
returns, so a test can stop a process mid-load and see whether anything of it stays there."""

from engine.tensor_channel import WorkerTensorChannel
from pipelines.toy_world import ToyWorldService
from spec_tests.cluster.gated_world import get_service as gated_service

HELD: list[WorkerTensorChannel] = []  # what a real pipeline's stage groups hold while they build their models


def get_service(gpu_num: int = 0, **_: object) -> ToyWorldService:
    HELD.append(WorkerTensorChannel(1, timeout=60.0))
    return gated_service(gpu_num)
