"""An in-process worker whose pipeline never loads fails at the load deadline and is replaced.

A load that hung in its thread (a stalled download, a device that never answers) kept the worker ``loading`` for
ever: health said degraded, every create was a 503 asking to retry, and nothing said why. A process worker's child
was already bounded (it is killed past its start deadline); the in-process load now is too
(:data:`server.model_worker.LOAD_TIMEOUT`), on trio's virtual clock here.
"""

from __future__ import annotations

import threading
from typing import Any

import trio

from server.model_worker import LOAD_TIMEOUT

from .conftest import make_settings, serve, toy_loader, wait_ready, wait_until


class FirstLoadHangs:
    """A toy loader whose first load blocks (in the worker's loading thread) until released; later ones load."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.loads = 0
        self._inner = toy_loader()

    def __call__(self, path: str, **options: Any) -> Any:
        self.loads += 1
        if self.loads == 1:
            self.entered.set()
            self.release.wait()
        return self._inner(path, **options)


async def test_a_pipeline_load_that_hangs_fails_its_worker_at_the_deadline_and_a_new_one_loads(autojump_clock):
    loader = FirstLoadHangs()
    async with serve(make_settings(), loader=loader, ready=False) as served:
        try:
            await trio.to_thread.run_sync(loader.entered.wait)
            begun = trio.current_time()
            await wait_until(lambda: loader.loads >= 2, "the worker to fail and its replacement to load")
            assert trio.current_time() - begun >= LOAD_TIMEOUT  # never before the deadline
            status, metadata, _ = await served.json("get", "/v1/service/metadata")
            assert status == 200
            reasons = list(metadata["worker_failures"].values())
            assert reasons and f"the pipeline did not load within {LOAD_TIMEOUT:g} s" in str(reasons), reasons
            await wait_ready(served.runtime)  # the replacement loaded (the hung thread is left to its call)
            status, health, _ = await served.json("get", "/v1/service/health")
            assert status == 200 and health["ready"] is True
        finally:
            loader.release.set()
