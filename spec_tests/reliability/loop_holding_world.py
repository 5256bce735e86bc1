"""A pipeline whose ``check_options`` holds trio's thread: a synchronous sleep in an ``async def`` (a create with
``{"hold": true}`` among its options, or ``{"hold": 8}`` for 8 s), as a check that loads or downloads something
without awaiting would."""

from __future__ import annotations

import itertools
import sys
import time
from contextlib import asynccontextmanager

import numpy as np
import trio

from pipelines.contract import BidirectionalService, Chunk

HOLD_SECONDS = 120.0  # past every deadline of the test that makes a server meet it


class LoopHolder(BidirectionalService):
    takes_prompt = False
    takes_image = False

    @asynccontextmanager
    async def running(self):
        yield self

    async def check_options(self, options):
        hold = options.get("hold")
        if hold:
            sys.stderr.write("holding the loop\n")
            sys.stderr.flush()
            # the bug under test, a synchronous call that holds trio's thread (``true``: past every deadline)
            time.sleep(HOLD_SECONDS if hold is True else float(hold))  # bench-cost: the bug under test

    async def create_session(self, config, *, on_event=None):
        return "s"

    async def push_control(self, session_id, control):
        pass

    async def chunks(self, session_id):
        for index in itertools.count():  # a frame now and then, while a session that was made stays
            yield Chunk(index=index, frames=np.zeros((1, 8, 8, 3), np.uint8), fps=8)
            await trio.sleep(0.5)  # bench-cost: the stream's pace, a frame now and then

    async def close_session(self, session_id):
        pass


def get_service(gpu_num=0):
    return LoopHolder()
