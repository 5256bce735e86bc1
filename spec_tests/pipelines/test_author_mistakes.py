"""A pipeline author's mistakes in the service contract, as ``chunkline run`` and the startup check tell them.

Each is told with what was wrong and where, at load time where it can be (``running()`` written as a
plain ``async def``), else when it happens (a chunk that is not a ``Chunk``; a teardown hook that fails
the warm-up session's close after a good chunk).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.loader import PipelineLoadError, load_service
from pipelines.validation import PipelineValidationError, validate_service
from server.cli import main

from .minimal_service import MinimalService


def pipeline_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "author_pipeline.py"
    path.write_text(
        "from spec_tests.pipelines.minimal_service import MinimalService\n\n"
        f"{body}\n\n"
        "def get_service(gpu_num=0):\n"
        "    return Broken()\n"
    )
    return str(path)


RUNNING_COROUTINE = """
class Broken(MinimalService):
    async def running(self):
        return None
"""

RUNNING_GENERATOR = """
class Broken(MinimalService):
    async def running(self):
        yield
"""

CHUNKS_COROUTINE = """
class Broken(MinimalService):
    async def chunks(self, session_id):
        return []
"""


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (RUNNING_COROUTINE, "running() is an 'async def'; it must return an async context manager"),
        (RUNNING_GENERATOR, "@contextlib.asynccontextmanager"),
        (CHUNKS_COROUTINE, "chunks() is an 'async def' without 'yield'"),
    ],
    ids=["running_coroutine", "running_async_generator", "chunks_coroutine"],
)
def test_a_contract_method_of_the_wrong_kind_is_refused_at_load_naming_it(
    body: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = pipeline_file(tmp_path, body)
    with pytest.raises(PipelineLoadError, match="Broken in") as refused:
        load_service(path)
    assert named in str(refused.value)
    out = tmp_path / "out"
    assert main(["run", path, "--chunks", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert named in err and "RuntimeWarning" not in err and "never awaited" not in err
    assert not out.exists()


def test_a_chunk_that_is_not_a_chunk_fails_the_run_naming_what_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = pipeline_file(
        tmp_path, "class Broken(MinimalService):\n    def __init__(self):\n        super().__init__(dict_chunks=True)"
    )
    out = tmp_path / "out"
    assert main(["run", path, "--chunks", "2", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "the pipeline yielded a dict as chunk 0, not a pipelines.contract.Chunk" in err
    assert not (out / "video.mp4").exists() and not (out / "metrics.json").exists()


async def test_a_failing_teardown_after_a_good_warm_up_chunk_is_told_as_the_close() -> None:
    service = MinimalService(close_fails=True)
    async with service.running():
        with pytest.raises(PipelineValidationError) as failed:
            await validate_service(service, timeout=10)
    assert str(failed.value) == "closing the warm-up session failed: RuntimeError: teardown failed"
