"""A worker's failure reason says what failed, also when the pipeline's own nursery gathered several errors.

A pipeline's ``running()`` that opens a nursery (a feeding task beside the body, as the engine's example does) fails
with a group of errors; health and metadata read only ``ExceptionGroup: Exceptions from Trio nursery (2
sub-exceptions)``, the errors that say why hidden inside.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from pipelines.loader import OptionValuesRefused
from server.reasons import MAX_REASON
from spec_tests.server.runner_fixtures import CounterService

from .conftest import make_settings, serve, wait_worker_failed


class TwoFailingTasks(CounterService):
    """A service whose ``running()`` starts two tasks that fail at once."""

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Any]:
        async def fails(error: Exception) -> None:
            raise error

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fails, KeyError("weights.pt"))
            nursery.start_soon(fails, OSError("the device went away"))
            yield self


async def test_a_worker_whose_pipeline_raised_several_errors_at_once_names_each() -> None:
    async with serve(make_settings(), loader=lambda path, **_: TwoFailingTasks(), ready=False) as served:
        await wait_worker_failed(served.runtime)
        status, metadata, _ = await served.json("get", "/v1/service/metadata")
    assert status == 200
    (reason, *_) = metadata["worker_failures"].values()
    assert "ExceptionGroup" not in reason, reason
    assert "the pipeline raised 2 errors at once: " in reason, reason  # in the order the tasks failed
    assert "KeyError: 'weights.pt'" in reason and "OSError: the device went away" in reason, reason


async def test_the_log_line_of_a_worker_whose_pipeline_refused_its_options_says_all_of_why(caplog: Any) -> None:
    """Health and metadata show a failure's reason cut to one short line; the log keeps the detail. A refusal's line
    (no traceback follows it) was that cut line too: a refused placement's ended before it named the stage and the
    fault (``refused its options: inline placement JSON: stage 'e...``)."""
    why = "inline placement JSON: stage 'encode' " + "asks for a device this host does not have; " * 10 + "the end"

    def refusing(path: Any, **_: Any) -> Any:
        raise OptionValuesRefused(f"get_service() in {str(path)!r} refused its options: {why}")

    async with serve(make_settings(), loader=refusing, ready=False) as served:
        await wait_worker_failed(served.runtime)
        status, metadata, _ = await served.json("get", "/v1/service/metadata")
    (reason, *_) = metadata["worker_failures"].values()
    # the short line, for everyone: its start and its end, the cause (it ended before it named it)
    assert len(reason) <= MAX_REASON and " ... " in reason and reason.endswith("the end"), reason
    assert reason.startswith("OptionValuesRefused: get_service() in "), reason
    lines = [record.getMessage() for record in caplog.records if "could not load the pipeline" in record.getMessage()]
    assert lines and all(line.endswith(f"refused its options: {why}") for line in lines), lines
