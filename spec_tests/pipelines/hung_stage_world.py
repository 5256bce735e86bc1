"""A pipeline whose model stage hangs for good from chunk ``HANG_FROM`` on, for the Ctrl-C tests of
``chunkline run``: closing it waits the orchestrator's default ``close_timeout`` (300 s) for the stage."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from engine import open_orchestrator
from spec_tests.reliability.fault_pipelines import SPEC, EngineService

HANG_FROM = 12  # more chunks than the offline writer's queue holds, so its temporary file exists


class HungStageService(EngineService):
    def _denoise_sync(self, invocation: Any) -> dict[str, Any]:
        if invocation.key.sequence_id >= HANG_FROM:
            threading.Event().wait()  # a model call that never returns
        return super()._denoise_sync(invocation)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[HungStageService]:
        self.actors = self._build_actors()
        async with open_orchestrator(SPEC, self.actors) as orch:  # the default close_timeout
            self.orch = orch
            yield self


def get_service(gpu_num: int = 0) -> HungStageService:
    return HungStageService(frames_per_chunk=8)  # enough frames for the encoder to write before the hang
