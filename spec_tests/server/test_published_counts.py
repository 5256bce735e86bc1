"""The server's metrics count what a session's ``done`` message counts: every frame that reached the room, and every
chunk its pipeline made.

``done`` counted the frames of a chunk cut short by the session's end (they were published), while
``chunkline_frames_published_total`` counted whole chunks only (``total_chunks 3, published_frames 14`` with 4-frame
chunks, against 12 in the metric); and ``chunkline_chunks_total{result="processed"}`` stayed 0 for a pipeline that
reports no ``stage_times`` (most do not), however many chunks it made.
"""

from __future__ import annotations

from typing import Any

import pytest

from .runner_fixtures import CounterService, no_threads, serve, settings  # noqa: F401  (fixture)
from .runner_fixtures import join
from .test_runner import worker_gone

FRAMES_PER_CHUNK = 4


@pytest.mark.usefixtures("no_threads")
async def test_a_chunk_cut_short_counts_its_published_frames_in_the_metrics_as_in_done(autojump_clock: Any) -> None:
    service = CounterService(fps=10, frames_per_chunk=FRAMES_PER_CHUNK)  # no stage_times in its chunks
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            # two frames into its fourth chunk (frames go out one by one, 0.1 s apart)
            await ctl.wait_for(lambda p: len(p.frames()) >= 3 * FRAMES_PER_CHUNK + 2, "14 frames")
            await ctl.control({"type": "stop"})
            (done,) = await ctl.wait_for(lambda p: p.status("done"), "done")
            await worker_gone(ctl)
        summary = s.runtime.metrics.summary()
    assert done["published_frames"] == len(ctl.frames())
    assert done["published_frames"] > done["total_chunks"] * FRAMES_PER_CHUNK, done  # one chunk was cut short
    assert summary["frames_published"] == done["published_frames"], (summary, done)
    assert summary["chunks"]["published"] == done["total_chunks"], (summary, done)
    # every chunk it made is counted as processed, the one cut short too, without a compute time to observe
    assert summary["chunks"]["processed"] == done["total_chunks"] + 1, (summary, done)
    assert summary["chunk_latency_seconds"]["count"] == 0, summary
