"""Mistakes a new author makes in a pipeline file, each told in one line naming it, at load or in the run.

- ``async def get_service``: it was called and its coroutine dropped, ``returned coroutine; it must return ...``
  with a ``RuntimeWarning: coroutine 'get_service' was never awaited`` after it;
- ``return MyService`` (the class, not an instance) read ``returned ABCMeta``;
- a ``get_service`` without ``gpu_num`` read ``does not accept ['gpu_num']``, a parameter the author never gave;
- a module of a package folder given as the pipeline (``pkg/service.py``) with a relative import failed with
  ``attempted relative import with no known parent package``;
- ``running()`` under ``@contextlib.contextmanager`` (or a plain generator), and ``def chunks``/``def stream`` with
  ``yield``, loaded and then failed the run in Python's words (``'generator' object has no attribute '__anext__'``);
- a ``create_session`` that needs an option failed the server's startup check as ``the warm-up chunk failed:
  ValueError: ...``, naming neither the session nor its default config;
- a ``chunks()``/``stream()`` that returns a list read ``'list' object has no attribute '__anext__'``;
- ``def create_session`` (or ``push_control``, ``close_session``, ``check_options``) without ``async`` loaded and
  failed in the run: ``object str can't be used in 'await' expression``;
- a stage error in an engine graph whose ``running()`` opens a nursery for the session's feeding task (the
  README's own example pushes from a task) failed the run with ``ExceptionGroup: Exceptions from Trio nursery
  (2 sub-exceptions)``: the chunk's failure and the feeder's refused push, gathered by the author's nursery.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from engine import EdgeSpec, LocalStageActor, PipelineSpec, StageSpec, open_orchestrator
from pipelines.contract import (
    BidirectionalService, Chunk, Control, PipelineContractError, ServerPushService, SessionConfig)
from pipelines.loader import OptionsNotAccepted, PipelineLoadError, load_service
from pipelines.offline import ChunkFailed, run_offline
from pipelines.validation import PipelineValidationError, validate_service
from server.run_command import run_deadlines

from .minimal_service import MinimalService

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import its pipeline and fail
MINIMAL = "from spec_tests.pipelines.minimal_service import MinimalService\n"


def pipeline(folder: Path, text: str, name: str = "p.py") -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_an_async_get_service_is_refused_naming_it_without_a_coroutine_left_unawaited(tmp_path: Path) -> None:
    path = pipeline(tmp_path, MINIMAL + "async def get_service(gpu_num=0):\n    return MinimalService()\n")
    with pytest.raises(PipelineLoadError, match=r"get_service\(\) in .* is an 'async def'; it must be a plain 'def'"):
        load_service(path, gpu_num=0)  # -W error: an unawaited coroutine's RuntimeWarning would fail the test


def test_get_service_returning_its_class_is_told_to_return_an_instance(tmp_path: Path) -> None:
    path = pipeline(tmp_path, MINIMAL + "def get_service(gpu_num=0):\n    return MinimalService\n")
    with pytest.raises(PipelineLoadError) as refused:
        load_service(path, gpu_num=0)
    assert "returned the class MinimalService, not a service; it must return an instance (MinimalService(...))" in (
        str(refused.value))


def test_a_get_service_without_gpu_num_is_told_that_chunkline_passes_it(tmp_path: Path) -> None:
    path = pipeline(tmp_path, MINIMAL + "def get_service():\n    return MinimalService()\n")
    with pytest.raises(OptionsNotAccepted) as refused:
        load_service(path, gpu_num=0)
    assert str(refused.value).endswith(
        "does not accept ['gpu_num']: chunkline calls every pipeline's get_service(gpu_num=N), N the GPUs it is "
        "given; add a gpu_num=0 parameter"), refused.value


def test_a_module_of_a_package_folder_loads_with_its_relative_imports(tmp_path: Path) -> None:
    pipeline(tmp_path, "", "pkg/__init__.py")
    pipeline(tmp_path, "CHUNKS = 3\n", "pkg/settings.py")
    path = pipeline(tmp_path, MINIMAL + "from .settings import CHUNKS\n\n"
                    "def get_service(gpu_num=0):\n    return MinimalService(chunks=CHUNKS)\n", "pkg/service.py")
    service = load_service(path, gpu_num=0)
    assert service.chunk_count == 3  # type: ignore[union-attr]
    assert load_service(path, gpu_num=0).chunk_count == 3  # type: ignore[union-attr]  # and again, as a worker's restart


def test_a_module_of_a_package_folder_named_from_inside_it_loads_too(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline(tmp_path, "", "pkg/__init__.py")
    pipeline(tmp_path, "CHUNKS = 2\n", "pkg/settings.py")
    pipeline(tmp_path, MINIMAL + "from .settings import CHUNKS\n\n"
             "def get_service(gpu_num=0):\n    return MinimalService(chunks=CHUNKS)\n", "pkg/service.py")
    monkeypatch.chdir(tmp_path / "pkg")  # `chunkline run service.py` there: its folder is '.', no package's name
    assert load_service("service.py", gpu_num=0).chunk_count == 2  # type: ignore[union-attr]


def test_a_module_of_a_package_folder_that_fails_to_import_names_the_file(tmp_path: Path) -> None:
    pipeline(tmp_path, "", "pkg/__init__.py")
    path = pipeline(tmp_path, "from .missing import X\n", "pkg/service.py")
    with pytest.raises(PipelineLoadError, match=r"importing pipeline file .*service\.py' failed: ModuleNotFoundError"):
        load_service(path, gpu_num=0)
    with pytest.raises(PipelineLoadError, match="ModuleNotFoundError"):  # tried again, not a half-made module kept
        load_service(path, gpu_num=0)


PUSH = """\
    import contextlib
    import numpy as np
    from pipelines.contract import Chunk, ServerPushService

    class Push(ServerPushService):
        {decorator}
        {running}running(self):
            yield

        {stream}stream(self, config):
            yield Chunk(0, np.zeros((2, 8, 8, 3), np.uint8), 8.0)

    def get_service(gpu_num=0):
        return Push()
"""


@pytest.mark.parametrize(("decorator", "running", "stream", "told"), [
    ("@contextlib.contextmanager", "def ", "async def ", "running() is a plain 'def' with 'yield'; it must be an 'async def' "
     "decorated with @contextlib.asynccontextmanager (not @contextlib.contextmanager)"),
    ("", "def ", "async def ", "running() is a plain 'def' with 'yield'"),
    # a new user's two slips (7 Dec): Python's words, and a fix that named the decorator they had not used
    ("@contextlib.contextmanager", "async def ", "async def ", "running() is an 'async def' decorated with "
     "@contextlib.contextmanager; decorate it with @contextlib.asynccontextmanager"),
    ("@contextlib.asynccontextmanager", "def ", "async def ", "running() is a plain 'def' with 'yield' decorated "
     "with @contextlib.asynccontextmanager; make it an 'async def'"),
    ("@contextlib.asynccontextmanager", "async def ", "def ", "stream() is a plain 'def' with 'yield'; it must be "
     "an async generator ('async def' with 'yield')"),
], ids=["contextmanager", "undecorated", "async_contextmanager", "plain_asynccontextmanager", "sync_stream"])
def test_a_plain_generator_where_the_contract_iterates_asynchronously_is_refused_at_load_naming_it(
        tmp_path: Path, decorator: str, running: str, stream: str, told: str) -> None:
    """They loaded, then failed the run: ``'_GeneratorContextManager' object does not support the asynchronous
    context manager protocol``, ``'generator' object has no attribute '__anext__'``."""
    path = pipeline(tmp_path, PUSH.format(decorator=decorator, running=running, stream=stream))
    with pytest.raises(PipelineLoadError) as refused:
        load_service(path, gpu_num=0)
    assert f"Push in {str(path)!r}: {told}" in str(refused.value)


@pytest.mark.parametrize("method", ["create_session", "check_options", "push_control", "close_session"])
def test_a_method_the_contract_awaits_written_as_a_plain_def_is_refused_at_load_naming_it(
        tmp_path: Path, method: str) -> None:
    """It loaded and failed the run: ``create_session raised TypeError: object str can't be used in 'await'
    expression`` (under the server, ``check_options`` made every create a 503)."""
    path = pipeline(tmp_path, MINIMAL + textwrap.dedent(f"""
        class Plain(MinimalService):
            def {method}(self, *args, **kwargs):
                return "s0"

        def get_service(gpu_num=0):
            return Plain()
        """))
    with pytest.raises(PipelineLoadError) as refused:
        load_service(path, gpu_num=0)
    assert str(refused.value).endswith(f"Plain in {str(path)!r}: {method}() is a plain 'def'; the contract awaits "
                                       f"it: make it an 'async def'"), refused.value


MEMBER_SLIPS = [  # a new user's (7 Dec), each loaded and failed later in Python's words, or never failed at all
    ("async def close_session(self, session_id):\n        yield",
     "close_session() is an async generator ('async def' with 'yield'); the contract awaits it: take the 'yield' out"),
    ("async def memory_report(self):\n        return None",
     "memory_report() is an 'async def'; the contract calls it without awaiting it: make it a plain 'def'"),
    ("async def configure_session_capacity(self, limit):\n        pass",
     "configure_session_capacity() is an 'async def'; the contract calls it without awaiting it: make it a plain "
     "'def'"),
    ("def failure(self):\n        return None",
     "failure is a method; it must be a property (decorate it with @property) or an attribute"),
    # a second pass (7 Dec): a @staticmethod is a function on the instance, not a method, and each went through
    ("@staticmethod\n    def create_session(config, *, on_event=None):\n        return 's1'",
     "create_session() is a plain 'def'; the contract awaits it: make it an 'async def'"),
    ("@staticmethod\n    def failure():\n        return None",
     "failure is a method; it must be a property (decorate it with @property) or an attribute"),
    ("def configure_session_capacity(self, limit):\n        yield",
     "configure_session_capacity() is a plain 'def' with 'yield'; the contract calls it once: take the 'yield' out"),
    ("@property\n    def memory_report(self):\n        return None",
     "memory_report is a property, not a method; the contract calls it: make it a method"),
]


@pytest.mark.parametrize(("member", "told"), MEMBER_SLIPS, ids=[
    "async-generator-close", "async-memory-report", "async-configure-capacity", "failure-method",
    "static-create-session", "static-failure", "generator-configure-capacity", "property-memory-report"])
def test_a_member_of_the_wrong_form_is_refused_at_load_naming_it(tmp_path: Path, member: str, told: str) -> None:
    """``close_session`` failed each close (``object async_generator can't be used in 'await' expression``); an
    ``async def memory_report`` failed the load with ``AttributeError: 'coroutine' object has no attribute
    'snapshots'``; an ``async def configure_session_capacity`` was never run (a ``RuntimeWarning``); a ``failure``
    method is never None, so the worker counted as failed for good and said why nowhere."""
    path = pipeline(tmp_path, MINIMAL + f"class Slipped(MinimalService):\n    {member}\n\n\n"
                    "def get_service(gpu_num=0):\n    return Slipped()\n")
    with pytest.raises(PipelineLoadError) as refused:
        load_service(path, gpu_num=0)
    assert str(refused.value).endswith(f"Slipped in {str(path)!r}: {told}"), refused.value


def test_the_repository_s_pipelines_still_load() -> None:
    for name in ("pipelines/replay", "pipelines/toy_world"):
        assert load_service(ROOT / name, gpu_num=0).kind in {"bidirectional", "server_push"}


# --- a stage error in an author's engine graph, its feeder in the nursery of running() -----------------------

def encode(invocation: object) -> dict[str, object]:
    raise KeyError("missing_weight")


def frames(invocation: object) -> dict[str, object]:
    return {"frames": np.zeros((2, 8, 8, 3), np.uint8)}


SPEC = PipelineSpec(
    stages=[StageSpec("encode", {"image"}, {"condition"}), StageSpec("decode", {"condition"}, {"frames"})],
    edges=[EdgeSpec("image", "encode", None, 2), EdgeSpec("condition", "decode", "encode", 2)],
    output_artifacts={"frames"}, output_capacity_per_session=2)


class FedFromRunning(BidirectionalService):
    """Its sessions are fed by a task of the nursery ``running()`` opens; the ``encode`` stage raises."""

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        actors = {"encode": LocalStageActor(encode), "decode": LocalStageActor(frames)}
        async with open_orchestrator(SPEC, actors) as orch, trio.open_nursery() as nursery:
            self.orch, self.nursery = orch, nursery
            yield
            nursery.cancel_scope.cancel()

    async def create_session(self, config: SessionConfig, *, on_event: object = None) -> str:
        return "s1"

    async def push_control(self, session_id: str, control: Control) -> None:
        pass

    async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        async with self.orch.session(session_id, final_sequence_id=3) as session:
            async def feed() -> None:
                for seq in range(4):
                    await session.push(seq, {"image": seq})  # refused once the stage failed the session
            self.nursery.start_soon(feed)
            async for seq, artifacts in session.outputs():
                yield Chunk(seq, artifacts["frames"], 8.0)
            if session.error is not None:
                raise RuntimeError(f"session failed: {session.error!r}")

    async def close_session(self, session_id: str) -> None:
        pass


async def test_a_stage_error_gathered_with_a_feeder_s_refused_push_fails_the_run_naming_the_chunk(
        tmp_path: Path) -> None:
    with pytest.raises(ChunkFailed) as failed:
        await run_offline(FedFromRunning(), SessionConfig(), None, 4, tmp_path, deadlines=run_deadlines())
    assert str(failed.value) == "the pipeline failed making chunk 0: RuntimeError: session failed: KeyError('missing_weight')"


class TwoFailingTasks(FedFromRunning):
    """Its ``running()`` nursery's two tasks both raise, neither in a call of the run's."""

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async def fails(exc: Exception) -> None:
            raise exc
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fails, KeyError("a"))
            nursery.start_soon(fails, OSError("b"))
            yield
            await trio.sleep_forever()

    async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        await trio.sleep_forever()  # until its tasks' errors cancel the run
        yield Chunk(0, np.zeros((2, 8, 8, 3), np.uint8), 8.0)


async def test_several_errors_of_the_pipeline_s_own_tasks_are_each_named(tmp_path: Path) -> None:
    with pytest.raises(PipelineContractError) as failed:
        await run_offline(TwoFailingTasks(), SessionConfig(), None, 4, tmp_path, deadlines=run_deadlines())
    told = str(failed.value)  # the tasks fail in trio's order, which it varies
    assert told.startswith("pipeline bug: the pipeline raised 2 errors at once: "), told
    assert sorted(told.split(": ", 2)[2].split("; ")) == ["KeyError: 'a'", "OSError: b"], told
    assert isinstance(failed.value.__cause__, BaseExceptionGroup)


def test_chunkline_run_of_that_engine_graph_exits_1_naming_the_stage_error(tmp_path: Path) -> None:
    path = pipeline(tmp_path, "from spec_tests.pipelines.test_pipeline_author_loads import FedFromRunning\n\n"
                    "def get_service(gpu_num=0):\n    return FedFromRunning()\n")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(path), "--chunks", "4", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "chunkline run: the run failed: the pipeline failed making chunk 0: RuntimeError: session failed: "
        "KeyError('missing_weight')"), done.stderr[-2000:]
    assert not out.exists()


# --- the server's startup check, whose session the author never asked for -------------------------------------

class NeedsAnOption(MinimalService):
    async def create_session(self, config: SessionConfig, *, on_event: object = None) -> str:
        if "scene" not in config.options:
            raise ValueError("option 'scene' is required")
        return "s0"


async def test_a_warm_up_session_its_create_refuses_says_which_session_and_what_to_do() -> None:
    """It read ``the warm-up chunk failed: ValueError: option 'scene' is required``: no chunk was asked for yet, and
    the author never made that session."""
    with pytest.raises(PipelineValidationError) as failed:
        await validate_service(NeedsAnOption(), timeout=30)
    assert str(failed.value) == (
        "create_session for the warm-up session (the default SessionConfig: no prompt, no image, no options) failed: "
        "ValueError: option 'scene' is required; make it take that, or serve with --skip-validation")


class ReturnsAList(ServerPushService):
    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        return [Chunk(0, np.zeros((2, 8, 8, 3), np.uint8), 8.0)]  # type: ignore[return-value]


class ChunksAsAList(MinimalService):
    def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        return [Chunk(0, np.zeros((2, 8, 8, 3), np.uint8), 8.0)]  # type: ignore[return-value]


@pytest.mark.parametrize(("service", "method"), [(ReturnsAList(), "stream()"), (ChunksAsAList(), "chunks()")],
                         ids=["stream", "chunks"])
async def test_a_stream_that_is_no_async_iterator_is_told_as_such_by_the_run_and_the_check(
        service: Any, method: str, tmp_path: Path) -> None:
    """It read ``AttributeError: 'list' object has no attribute '__anext__'`` (the run), ``... 'aclose'`` (the check)."""
    told = f"pipeline bug: {method} returned list, not an async iterator; make it an async generator ('async def' with 'yield')"
    with pytest.raises(PipelineContractError) as failed:
        await run_offline(service, SessionConfig(), None, 2, tmp_path, deadlines=run_deadlines())
    assert str(failed.value) == told
    with pytest.raises(PipelineValidationError) as checked:
        await validate_service(service, timeout=30)
    assert str(checked.value) == f"the warm-up chunk failed: PipelineContractError: {told}"


class NeedsAVideo(ServerPushService):
    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    async def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        if "video" not in config.options:
            raise ValueError("option 'video' is required")
        yield Chunk(0, np.zeros((2, 8, 8, 3), np.uint8), 8.0)


async def test_a_warm_up_stream_that_needs_an_option_says_the_check_gave_it_none() -> None:
    with pytest.raises(PipelineValidationError) as failed:
        await validate_service(NeedsAVideo(), timeout=30)
    assert str(failed.value) == ("the warm-up chunk failed (a stream of the default SessionConfig: no prompt, no image, "
                                 "no options): ValueError: option 'video' is required")
