"""A setting given on purpose that the pipeline's ``get_service`` does not take is said as the worker loads.

``--default-fps`` and ``--control-idle-timeout`` reach a pipeline only if its ``get_service`` names ``fps`` /
``control_idle_timeout``. One that misspelt the name (``fsp=``) got neither, and the server said nothing: the
sessions ran at the pipeline's own rate, the flag taken and ignored.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest

from pipelines.loader import load_service

from .conftest import make_settings, serve

PIPELINE = textwrap.dedent('''
    from spec_tests.server.runner_fixtures import CounterService


    def get_service(gpu_num=0, fsp=10.0, control_idle_timeout=10.0):
        return CounterService(fps=fsp)
''')


async def test_a_given_setting_the_pipeline_does_not_take_is_said_once_and_a_taken_one_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pipeline = tmp_path / "misspelt.py"
    pipeline.write_text(PIPELINE)
    settings = make_settings(pipeline=str(pipeline), default_fps=24, control_idle_timeout=30)
    with caplog.at_level(logging.WARNING, logger="chunkline.runtime"):
        async with serve(settings, loader=load_service) as served:
            status, metadata, _ = await served.json("get", "/v1/service/metadata")
    assert status == 200 and "control_idle_timeout" in str(metadata["worker_settings"]), metadata["worker_settings"]
    told = [r.getMessage() for r in caplog.records if "does not reach it" in r.getMessage()]
    assert told == ["the pipeline's get_service() takes no 'fps', so --default-fps 24 does not reach it (metadata's "
                    "worker_settings lists what it takes)"], told
