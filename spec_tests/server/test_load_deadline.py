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
from trio.testing import wait_all_tasks_blocked

from server.model_worker import LOAD_TIMEOUT

from .conftest import make_settings, serve, toy_loader, wait_ready, wait_worker_failed

#: more than a slot's first restart backoff (1 s)
RESTART_WAIT = 5.0


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


async def test_a_pipeline_load_that_hangs_fails_its_worker_at_the_deadline_and_a_new_one_loads(mock_clock):
    """A manual clock: the replacement's load takes real time in its thread, and an autojumping clock raced past its
    own deadline meanwhile (every replacement failed the same way)."""
    loader = FirstLoadHangs()
    async with serve(make_settings(), loader=loader, ready=False) as served:
        try:
            await trio.to_thread.run_sync(loader.entered.wait)
            mock_clock.jump(LOAD_TIMEOUT - 1)
            await wait_all_tasks_blocked()
            assert not any(w.failure for w in served.runtime.workers.values())  # never before the deadline
            mock_clock.jump(1)
            await wait_worker_failed(served.runtime)
            status, metadata, _ = await served.json("get", "/v1/service/metadata")
            assert status == 200
            reasons = list(metadata["worker_failures"].values())
            assert reasons and f"the pipeline did not load within {LOAD_TIMEOUT:g} s" in str(reasons), reasons
            mock_clock.jump(RESTART_WAIT)  # the slot's backoff before its replacement
            await wait_ready(served.runtime)  # the replacement loaded (the hung thread is left to its call)
            assert loader.loads == 2
            status, health, _ = await served.json("get", "/v1/service/health")
            assert status == 200 and health["ready"] is True
        finally:
            loader.release.set()
