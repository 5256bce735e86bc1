"""A pipeline that breaks the service contract while serving fails its session with a reason that names what
the pipeline did wrong and calls it a pipeline bug: a session id that is not a string, chunk indexes that skip,
a chunk that is not a ``Chunk``. Through the app's HTTP API and the local room protocol (a controller in the
room), with :class:`~spec_tests.server.runner_fixtures.CounterService` on virtual time."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from fractions import Fraction
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio

from pipelines.contract import Chunk, PipelineContractError, ServerPushService, SessionConfig
from server.process_service import start_process_service

from .runner_fixtures import WORKER_IDENTITY, CounterService, join, no_threads, serve, settings, wait_until  # noqa: F401


class IntSessionIds(CounterService):
    """``create_session`` returns an int; everything else works with it."""

    closed_with: Any = None

    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        self.real_id = await super().create_session(config, on_event=on_event)
        return 42  # type: ignore[return-value]

    def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        return super().chunks(self.real_id)

    async def close_session(self, session_id: str) -> None:
        self.closed_with = session_id
        await super().close_session(self.real_id)


async def _changed(chunks: AsyncIterator[Chunk], change: Any) -> AsyncIterator[Any]:
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            yield change(chunk)


class SkippingIndexes(CounterService):
    def chunks(self, session_id: str) -> AsyncIterator[Chunk]:  # 0, 2, 4, ...
        return _changed(super().chunks(session_id), lambda chunk: attrs.evolve(chunk, index=chunk.index * 2))


class DictsLater(CounterService):
    def chunks(self, session_id: str) -> AsyncIterator[Any]:  # two chunks, then dicts
        return _changed(super().chunks(session_id), lambda chunk: chunk if chunk.index < 2 else {"frames": chunk.frames})


class UnsendableMetadata(CounterService):
    """Chunk 1's metadata holds a number JSON cannot carry (a fraction too large for a float)."""

    def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        return _changed(super().chunks(session_id), lambda chunk: chunk if chunk.index != 1 else attrs.evolve(
            chunk, metadata={**chunk.metadata, "pose": Fraction(10**400)}))


class ListStageTimes(CounterService):
    def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        return _changed(super().chunks(session_id), lambda chunk: attrs.evolve(chunk, metadata={"stage_times": [0.1]}))


class SkippingStream(ServerPushService):
    """A server-push stream whose indexes run 0, 2, 4, ..."""

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    async def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        for index in range(0, 100, 2):
            yield Chunk(index, np.full((2, 16, 16, 3), 100, np.uint8), 10.0)


CASES = [
    (IntSessionIds, "pipeline bug: create_session returned int 42, not a session id (a non-empty str)", 0),
    (SkippingIndexes, "pipeline bug: chunk indexes must run 0, 1, 2, ... in order; chunk 1 of the stream has index 2", 1),
    (DictsLater, "pipeline bug: the pipeline yielded a dict as chunk 2, not a pipelines.contract.Chunk", 2),
    (UnsendableMetadata, "pipeline bug: chunk 1's metadata key 'pose' cannot be sent as JSON in its tf.status "
     "message: OverflowError: integer division result too large for a float", 1),
    (ListStageTimes, "pipeline bug: chunk 0's metadata key 'stage_times' is a list, not a mapping of stage name to "
     "seconds", 0),
    (SkippingStream, "pipeline bug: chunk indexes must run 0, 1, 2, ... in order; chunk 1 of the stream has index 2", 1),
]


@pytest.mark.usefixtures("no_threads")
@pytest.mark.parametrize(("make", "reason", "published"), CASES, ids=[case[0].__name__ for case in CASES])
async def test_a_pipeline_that_breaks_the_contract_fails_the_session_naming_its_bug(
    make: type, reason: str, published: int, autojump_clock: Any
) -> None:
    service = make()
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            (error,) = await ctl.wait_for(lambda p: p.status("error"), "an error message")
            await ctl.wait_for(
                lambda p: any(m.get("type") == "participant_left" and m.get("identity") == WORKER_IDENTITY
                              for m in p.texts()), "the worker to leave")
        view = await s.get(created["session_id"])
        assert (view["status"], view["drain_cause"]) == ("failed", "pipeline_failed")  # the cause was null
        assert (error["reason"], error["detail"], view["error"]) == ("pipeline_failed", reason, reason)
        assert [m["index"] for m in ctl.status("chunk")] == list(range(published))  # the good chunks went out
        assert s.free_slots() == 1 and not s.runtime.runners
    if isinstance(service, IntSessionIds):
        assert service.closed_with == 42  # the pipeline's session is closed with what it returned
        assert view["pipeline_session_id"] is None


# -- the same bugs with the pipeline in a worker process (``--worker-mode process``) ---------------------------

BAD_CHUNKS_PIPELINE = """
import fractions
import os
import sys
import threading
from contextlib import asynccontextmanager

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "child_only"))  # a module the server process lacks
import child_only_mod

import numpy as np
import trio

from pipelines.contract import BidirectionalService, Chunk


class Frames:  # a class of the pipeline's own file, which the server process cannot import
    def __init__(self, frames):
        self.frames = frames


def third():
    frames = np.full((2, 16, 16, 3), 100, np.uint8)
    return {third}


class BadThirdChunk(BidirectionalService):
    @asynccontextmanager
    async def running(self):
        yield self

    async def create_session(self, config, *, on_event=None):
        return "only"

    async def push_control(self, session_id, control):
        pass

    async def chunks(self, session_id):
        for index in range(2):
            yield Chunk(index, np.full((2, 16, 16, 3), 100, np.uint8), 10.0)
        yield third()
        await trio.sleep_forever()

    async def close_session(self, session_id):
        pass


def get_service(gpu_num=0):
    return BadThirdChunk()
"""

PROCESS_CASES = [
    ("{'frames': frames}", "pipeline bug: the pipeline yielded a dict as chunk 2, not a pipelines.contract.Chunk"),
    ("threading.Lock()", "pipeline bug: the pipeline yielded a lock as chunk 2, not a pipelines.contract.Chunk"),
    ("Frames(frames)", "pipeline bug: the pipeline yielded a Frames as chunk 2, not a pipelines.contract.Chunk"),
    ("Chunk(2, frames, 10.0, metadata={'lock': threading.Lock()})",
     "pipeline bug: chunk 2 cannot be sent from the worker process (a Chunk's metadata and applied_controls must "
     "be plain data that pickles): TypeError: cannot pickle '_thread.lock' object"),
    ("Chunk(2, frames, 10.0, metadata={'frames': Frames(frames)})",
     "pipeline bug: chunk 2 cannot be sent from the worker process (a Chunk's metadata and applied_controls must "
     "be plain data that pickles): PicklingError: Frames is defined in the pipeline file itself, which the server "
     "process cannot import"),
    ("Chunk(2, frames, 10.0, metadata={'thing': child_only_mod.Thing()})",
     "pipeline bug: chunk 2 from the worker process does not load in the server process: child_only_mod.Thing "
     "cannot be imported: ModuleNotFoundError: No module named 'child_only_mod'"),
    ("Chunk(2, frames, 10.0, metadata={'thing': child_only_mod.FailsToLoad()})",
     "pipeline bug: chunk 2 from the worker process does not load in the server process: loading it raised "
     "ValueError: invalid literal for int() with base 10: 'not a number' (the last name it loaded: builtins.int)"),
    ("Chunk(2, frames, 10.0, metadata={'pose': fractions.Fraction(10**400)})",
     "pipeline bug: chunk 2's metadata key 'pose' cannot be sent as JSON in its tf.status message: OverflowError: "
     "integer division result too large for a float"),
]

#: a module beside the pipeline file that only the worker process puts on its path
CHILD_ONLY_MODULE = """
class Thing:
    pass


class FailsToLoad:
    def __reduce__(self):
        return int, ("not a number",)  # pickles; raises when it is loaded
"""


async def each_session_fails_alone(path: Path, reason: str, published: int) -> None:
    """Two sessions in turn on one process worker each fail with ``reason`` after ``published`` good chunks;
    the worker serves on (it never failed)."""
    async with serve(settings(pipeline=str(path), worker_mode="process", max_sessions_per_worker=1),
                     start_process_service) as s:
        for _ in range(2):  # the worker is still there for the next session
            created = await s.create("ctl")
            async with join(s, created["room"], created["token"]) as ctl:
                (error,) = await ctl.wait_for(lambda p: p.status("error"), "an error message", timeout=60.0)
            view = await s.get(created["session_id"])
            assert (view["status"], view["error"], error["detail"]) == ("failed", reason, reason)
            assert view["drain_cause"] == error["reason"] == "pipeline_failed", (view, error)  # the cause was null
            assert [m["index"] for m in ctl.status("chunk")] == list(range(published))  # the good chunks went out
            await wait_until(lambda: s.free_slots() == 1, "the slot to be free")
        assert [worker.failure for worker in s.runtime.workers.values()] == [None]


def write_pipeline(tmp_path: Path, text: str) -> Path:
    (tmp_path / "child_only").mkdir()
    (tmp_path / "child_only" / "child_only_mod.py").write_text(CHILD_ONLY_MODULE)
    path = tmp_path / "bad_pipeline.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("third", "reason"), PROCESS_CASES, ids=[
    "dict", "unpicklable", "own-class", "chunk-unpicklable", "chunk-of-own-class", "chunk-of-a-module-the-server-lacks",
    "chunk-that-raises-on-load", "chunk-metadata-not-json",
])
async def test_a_pipeline_in_a_worker_process_that_yields_what_is_not_a_chunk_fails_naming_its_bug(
    third: str, reason: str, tmp_path: Path
) -> None:
    """Not an error of the process service (a pickling error, a message the server could not read, a worker
    that failed for every session): the session fails, the worker serves on."""
    await each_session_fails_alone(write_pipeline(tmp_path, BAD_CHUNKS_PIPELINE.replace("{third}", third)), reason, 2)


BAD_VALUES_PIPELINE = BAD_CHUNKS_PIPELINE.replace("{third}", "Chunk(2, frames, 10.0)").replace(
    """    async def create_session(self, config, *, on_event=None):
        return "only"
""", """    async def create_session(self, config, *, on_event=None):
        {create}
""")

VALUE_CASES = [
    ("return child_only_mod.Thing()",
     "pipeline bug: the value create_session returned in the worker process does not load in the server process: "
     "child_only_mod.Thing cannot be imported: ModuleNotFoundError: No module named 'child_only_mod'"),
    # an event (a ServiceEvent: anything else is refused in the worker process) holding a value that does not load
    ("from pipelines.contract import ServiceEvent; "
     "on_event(ServiceEvent('only', 'lease_queued', {'why': child_only_mod.FailsToLoad()})); return 'only'",
     "pipeline bug: an event of the session from the worker process does not load in the server process: loading it "
     "raised ValueError: invalid literal for int() with base 10: 'not a number' (the last name it loaded: builtins.int)"),
]


@pytest.mark.parametrize(("create", "reason"), VALUE_CASES, ids=["session-id", "event"])
async def test_a_value_from_a_worker_process_that_does_not_load_fails_only_its_session(
    create: str, reason: str, tmp_path: Path
) -> None:
    """A session id or an event the server cannot unpickle is the session's pipeline bug, not the worker's."""
    await each_session_fails_alone(write_pipeline(tmp_path, BAD_VALUES_PIPELINE.replace("{create}", create)), reason, 0)


# -- a session the server could not take is closed in the worker process -----------------------------------------

ONE_SLOT_PIPELINE = """
import os
import sys
from contextlib import asynccontextmanager

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "child_only"))  # a module the server process lacks
import child_only_mod

import numpy as np
import trio

from pipelines.contract import BidirectionalService, Chunk, ServiceEvent


class Held:  # a class of the pipeline's own file, which the server process cannot import
    pass


class OneSlot(BidirectionalService):
    '''One slot: a session holds it until it is closed. The first three sessions get ids the server cannot take;
    a session whose prompt is "late" is made only once its caller has given up.'''

    def __init__(self):
        self.sessions = []  # what create_session returned, for the sessions not yet closed
        self.created = 0

    @asynccontextmanager
    async def running(self):
        yield self

    async def create_session(self, config, *, on_event=None):
        if self.sessions:
            raise RuntimeError(f"no free slot: {len(self.sessions)} session(s) still hold it")
        if config.prompt == "late":
            on_event(ServiceEvent("late", "creating"))
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                pass  # a model that finishes making the session anyway
        self.created += 1
        session = {make_id} if self.created <= 3 else f"s{self.created}"
        self.sessions.append(session)
        return session

    async def push_control(self, session_id, control):
        pass

    async def chunks(self, session_id):
        for index in range(2):
            yield Chunk(index, np.full((2, 16, 16, 3), 100, np.uint8), 10.0, metadata={"held": len(self.sessions)})
        await trio.sleep_forever()

    async def close_session(self, session_id):
        self.sessions = [held for held in self.sessions if held is not session_id and held != session_id]


def get_service(gpu_num=0):
    return OneSlot()
"""

NOT_TAKEN_CASES = [
    ("child_only_mod.Thing()",
     "pipeline bug: the value create_session returned in the worker process does not load in the server process: "
     "child_only_mod.Thing cannot be imported: ModuleNotFoundError: No module named 'child_only_mod'"),
    ("child_only_mod.FailsToLoad()",
     "pipeline bug: the value create_session returned in the worker process does not load in the server process: "
     "loading it raised ValueError: invalid literal for int() with base 10: 'not a number' (the last name it loaded: "
     "builtins.int)"),
    ("Held()",
     "pipeline bug: the value create_session returned cannot be sent from the worker process: PicklingError: Held is "
     "defined in the pipeline file itself, which the server process cannot import"),
]


@pytest.mark.parametrize(("make_id", "reason"), NOT_TAKEN_CASES, ids=["missing-module", "raises-on-load", "own-class"])
async def test_a_session_whose_id_the_server_cannot_take_is_closed_in_the_worker_process(
    make_id: str, reason: str, tmp_path: Path
) -> None:
    """The server never learns the id, so the worker process closes the session itself: its one slot is free for
    each next attempt (they do not pile up), and the session after them holds it alone."""
    path = write_pipeline(tmp_path, ONE_SLOT_PIPELINE.replace("{make_id}", make_id))
    async with serve(settings(pipeline=str(path), worker_mode="process", max_sessions_per_worker=1),
                     start_process_service) as s:
        for _ in range(3):
            created = await s.create("ctl")
            async with join(s, created["room"], created["token"]) as ctl:
                (error,) = await ctl.wait_for(lambda p: p.status("error"), "an error message", timeout=60.0)
            view = await s.get(created["session_id"])
            assert (view["status"], view["error"], error["detail"]) == ("failed", reason, reason)
            assert view["drain_cause"] == error["reason"] == "pipeline_failed", (view, error)  # the cause was null
            await wait_until(lambda: s.free_slots() == 1, "the slot to be free")
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            chunks = await ctl.wait_for(lambda p: p.status("chunk"), "a chunk", timeout=60.0)
        assert chunks[0]["data"]["held"] == 1  # this session alone holds the pipeline's slot
        assert (await s.get(created["session_id"]))["pipeline_session_id"] == "s4"


async def test_a_session_made_after_its_caller_gave_up_is_closed_in_the_worker_process(tmp_path: Path) -> None:
    """The caller is cancelled while the worker process makes the session; its id (one the server cannot load
    either) comes late, so the worker process closes the session itself and the next one gets the slot."""
    path = write_pipeline(tmp_path, ONE_SLOT_PIPELINE.replace("{make_id}", "child_only_mod.Thing()"))
    service = await trio.to_thread.run_sync(lambda: start_process_service(str(path)))
    async with service.running():
        creating = trio.Event()
        with trio.CancelScope() as caller:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: service.create_session(SessionConfig(prompt="late"),
                                                                  on_event=lambda _: creating.set()))
                await creating.wait()
                caller.cancel()
        assert caller.cancelled_caught
        with trio.fail_after(30):
            for _ in range(2):  # ids the server cannot take: each closed in the worker process
                with pytest.raises(PipelineContractError, match="does not load in the server process"):
                    await service.create_session(SessionConfig())
            assert await service.create_session(SessionConfig()) == "s4"
    assert service.failure is None
