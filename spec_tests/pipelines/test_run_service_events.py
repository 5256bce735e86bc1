"""A ``ServiceEvent`` whose type is not text is the pipeline's bug, named where it is made.

``chunkline run`` took it, made every chunk, and then failed the finished run in Python's words, naming neither the
event nor whose bug it was (``TypeError: '<' not supported between instances of 'str' and 'int'`` sorting the events
for ``metrics.json``; ``keys must be str, int, float, bool or None, not tuple`` writing it); the server's runner failed
on ``event.type.startswith``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_runs import failed_line, run_pipeline


PIPELINE = """\
from pipelines.contract import ServiceEvent
from spec_tests.pipelines.minimal_service import MinimalService


class Telling(MinimalService):
    async def create_session(self, config, *, on_event=None):
        on_event(ServiceEvent("s0", "warming_up"))
        on_event(ServiceEvent("s0", {kind}))
        return "s0"


def get_service(gpu_num=0):
    return Telling()
"""


@pytest.mark.parametrize(("kind", "shown"), [("5", "5"), ("('lease', 'granted')", "('lease', 'granted')")])
def test_an_event_type_that_is_not_text_fails_the_run_as_the_pipeline_s_bug(tmp_path: Path, kind: str,
                                                                             shown: str) -> None:
    assert failed_line(run_pipeline(tmp_path, PIPELINE.format(kind=kind))) == (
        f"chunkline run: the run failed: pipeline bug: a ServiceEvent's type must be text, got {shown}")


NOT_AN_EVENT = """\
from spec_tests.pipelines.minimal_service import MinimalService


class Telling(MinimalService):
    async def create_session(self, config, *, on_event=None):
        on_event({"type": "lease_granted"})
        return "s0"


def get_service(gpu_num=0):
    return Telling()
"""


def test_an_event_that_is_not_a_service_event_fails_the_run_as_the_pipeline_s_bug(tmp_path: Path) -> None:
    """It failed in Python's words: ``create_session raised AttributeError: 'dict' object has no attribute 'type'``."""
    assert failed_line(run_pipeline(tmp_path, NOT_AN_EVENT)) == (
        "chunkline run: the run failed: pipeline bug: on_event takes a pipelines.contract.ServiceEvent, got dict "
        "{'type': 'lease_granted'}")


OTHER_SESSIONS_EVENT = """\
from spec_tests.pipelines.minimal_service import MinimalService
from pipelines.contract import ServiceEvent


class Telling(MinimalService):
    async def create_session(self, config, *, on_event=None):
        self.sink = on_event
        return "s0"

    async def chunks(self, session_id):
        self.sink(ServiceEvent("s1", "lease_granted"))  # a session this run never made
        async for chunk in super().chunks(session_id):
            yield chunk


def get_service(gpu_num=0):
    return Telling()
"""


def test_an_event_naming_another_session_fails_the_run_as_the_pipeline_s_bug(tmp_path: Path) -> None:
    """It was counted as the run's own session's in ``metrics.json``."""
    assert failed_line(run_pipeline(tmp_path, OTHER_SESSIONS_EVENT)).startswith(
        "chunkline run: the run failed: pipeline bug: on_event of session 's0' was handed an event of session 's1' "
        "('lease_granted')")
