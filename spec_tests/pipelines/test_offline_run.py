"""Offline runs (``run_offline``): the timed controls file, controls applied on the media clock, video.mp4 +
metrics.json, and a failed or interrupted run that leaves no output (``chunkline run`` itself:
test_chunkline_run.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio

from pipelines.contract import Audio, Chunk, Control, ControlType, SessionConfig
from pipelines.offline import TimedControls, load_timed_controls, parse_timed_controls, run_offline

from .offline_helpers import (
    DEADLINES,
    EXPECTED_COUNTERS,
    METRIC_KEYS,
    SUMMARY_KEYS,
    TIMED,
    CounterWorld,
    decoded_video,
    files_in,
)


# --- the timed controls file --------------------------------------------------------------------------------


def test_parses_every_entry_type_with_key_aliases_in_time_order() -> None:
    controls = parse_timed_controls(
        [
            {"t": 2, "type": "control_state", "controls": ["ArrowLeft", "KeyJ", "backward"]},
            {"t": 0, "type": "control", "control": "ArrowUp", "event": "press"},
            {"t": 0, "type": "control", "control": "forward", "event": "release"},
            {"t": 1.5, "type": "control", "control": "RIGHT"},
            {"t": 3, "type": "prompt", "prompt": "a snowy street"},
            {"t": 4, "type": "reset"},
            {"t": 4, "type": "reset_pose"},
            {"t": 5, "type": "control_state", "controls": []},
        ]
    )
    assert [(e.t, e.entry) for e in controls.entries] == [(0, 1), (0, 2), (1.5, 3), (2, 0), (3, 4), (4, 5), (4, 6), (5, 7)]
    assert [e.control for e in controls.entries] == [
        Control(ControlType.CONTROL, key="w", pressed=True),
        Control(ControlType.CONTROL, key="w", pressed=False),
        Control(ControlType.CONTROL, key="d", pressed=True),  # event defaults to press
        Control(ControlType.CONTROL_STATE, keys=frozenset({"a", "j", "s"})),
        Control(ControlType.PROMPT, prompt="a snowy street"),
        Control(ControlType.RESET),
        Control(ControlType.RESET_POSE),
        Control(ControlType.CONTROL_STATE, keys=frozenset()),
    ]
    aliases = {"ArrowUp": "w", "ArrowDown": "s", "ArrowLeft": "a", "ArrowRight": "d", "up": "w", "down": "s"}
    aliases |= {"left": "a", "right": "d", "forward": "w", "backward": "s"}
    aliases |= {f"Key{k.upper()}": k for k in "wasdijkl"} | {k: k for k in "wasdijkl"}
    for alias, key in aliases.items():
        (entry,) = parse_timed_controls([{"t": 0, "type": "control", "control": alias, "event": "press"}]).entries
        assert entry.control.key == key, alias


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"t": 1, "type": "control", "control": "q", "event": "press"}, "unknown control 'q'"),
        ({"t": 1, "type": "control", "control": "w", "event": "tap"}, "'event' must be"),
        ({"t": 1, "type": "control", "event": "press"}, "needs 'control'"),
        ({"t": 1, "type": "control_state", "controls": "w"}, "must be a list"),
        ({"t": 1, "type": "control_state", "controls": ["w", "ArrowUp"]}, "twice"),
        ({"t": 1, "type": "control_state", "controls": ["KeyZ"]}, "unknown control 'KeyZ'"),
        ({"t": 1, "type": "prompt", "prompt": "  "}, "non-empty"),
        ({"t": 1, "type": "stop"}, "unknown or missing type 'stop'"),
        ({"t": 1}, "unknown or missing type None"),
        ({"type": "reset"}, "missing time 't'"),
        ({"t": -1, "type": "reset"}, "'t' must be"),
        ({"t": "1", "type": "reset"}, "'t' must be"),
        ({"t": True, "type": "reset"}, "'t' must be"),
        ({"t": 1, "type": "reset", "control": "w"}, "unexpected field"),
        (["t", 1], "must be a JSON object"),
    ],
)
def test_a_bad_entry_names_its_index_and_problem(entry: Any, problem: str) -> None:
    good = {"t": 0, "type": "reset"}
    with pytest.raises(ValueError, match="controls entry 1: ") as caught:
        parse_timed_controls([good, entry])
    assert problem in str(caught.value)


def test_a_bad_file_is_a_value_error_naming_it(tmp_path: Path) -> None:
    not_json = tmp_path / "a.json"
    not_json.write_text("[{")
    with pytest.raises(ValueError, match="a.json.*not valid JSON"):
        load_timed_controls(not_json)
    not_list = tmp_path / "b.json"
    not_list.write_text('{"t": 0}')
    with pytest.raises(ValueError, match="b.json.*JSON list"):
        load_timed_controls(not_list)
    with pytest.raises(ValueError, match="cannot be read"):
        load_timed_controls(tmp_path / "missing.json")
    bad_entry = tmp_path / "c.json"
    bad_entry.write_text(json.dumps([{"t": 0, "type": "reset"}, {"t": 1, "type": "reset"}, {"t": 2, "type": "x"}]))
    with pytest.raises(ValueError, match="c.json.*controls entry 2"):
        load_timed_controls(bad_entry)


# --- run_offline with a bidirectional service ---------------------------------------------------------------


async def test_controls_apply_to_the_right_chunk_on_the_media_clock(tmp_path: Path) -> None:
    world = CounterWorld()
    done: list[tuple[int, int]] = []
    summary = await run_offline(
        world, SessionConfig(prompt="a street"), parse_timed_controls(TIMED), 8, tmp_path, progress=lambda d, t: done.append((d, t)),
        deadlines=DEADLINES,
    )
    assert done == [(i, 8) for i in range(1, 9)]
    # each control was pushed right before the chunk it belongs to was requested
    assert world.pushes == [
        ("control", 0),
        ("control", 2),
        ("control_state", 3),
        ("prompt", 4),
        ("reset", 5),
        ("control", 6),
        ("reset_pose", 7),
    ]
    assert world.closed_sessions == ["s0"]

    frames, kinds = decoded_video(tmp_path / "video.mp4")
    assert kinds == ["video"]  # the chunks carried no audio
    assert len(frames) == 8 * CounterWorld.FRAMES
    assert frames[0].shape == (CounterWorld.HEIGHT, CounterWorld.WIDTH, 3)
    means = [float(np.mean(frames[i * 4 : i * 4 + 4])) for i in range(8)]
    assert means == pytest.approx([100 + 20 * c for c in EXPECTED_COUNTERS], abs=4)

    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics == summary.metrics
    assert METRIC_KEYS <= set(metrics)
    assert metrics["kind"] == "bidirectional"
    assert (metrics["chunks"], metrics["frames"], metrics["fps"]) == (8, 32, 8.0)
    assert metrics["chunk_media_seconds"] == 0.5 and metrics["media_seconds"] == 4.0
    assert metrics["audio"] is None and metrics["ended_early"] is False
    controls = metrics["controls"]
    assert (controls["scheduled"], controls["pushed"], controls["rejected"], controls["not_reached"]) == (9, 7, 1, 1)
    assert [(e["entry"], e["chunk"]) for e in controls["entries"]] == [(0, 0), (1, 2), (2, 3), (3, 4), (4, 4), (5, 5), (6, 6), (7, 7)]
    assert controls["entries"][4]["rejected"] == "prompt refused"
    c2o = metrics["control_to_output_latency"]
    assert set(c2o) == SUMMARY_KEYS and c2o["count"] == 7 and 0 <= c2o["p50_seconds"] <= c2o["p95_seconds"]
    assert metrics["chunk_period"]["count"] == 7
    assert metrics["real_time_factor"] == pytest.approx(metrics["chunk_period"]["p95_seconds"] / 0.5)
    assert metrics["first_output_latency_seconds"] >= 0
    assert metrics["stage_times"] == {
        "draw": {"count": 8, "mean_seconds": pytest.approx(0.001)},
        "step": {"count": 8, "mean_seconds": pytest.approx(0.002)},
    }
    assert metrics["idle_reasons"] == {"continuous": {"count": 8, "idle_seconds": 0.0}}
    assert metrics["events"] == {"session_ready": 1}
    assert files_in(tmp_path) == ["metrics.json", "video.mp4"]


async def test_a_run_without_controls_or_stage_metadata(tmp_path: Path) -> None:
    class Plain(CounterWorld):
        async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
            async with aclosing(super().chunks(session_id)) as inner:
                async for chunk in inner:
                    yield attrs.evolve(chunk, metadata={})

    summary = await run_offline(Plain(), SessionConfig(), None, 2, tmp_path / "new" / "dir", deadlines=DEADLINES)
    assert summary.chunks == 2 and summary.video_path == tmp_path / "new" / "dir" / "video.mp4"
    assert summary.metrics["stage_times"] == {} and summary.metrics["idle_reasons"] == {}
    assert summary.metrics["control_to_output_latency"]["count"] == 0


async def test_a_failed_run_leaves_no_output(tmp_path: Path) -> None:
    world = CounterWorld(fail_at=2)
    with pytest.raises(RuntimeError, match="fell over"):
        await run_offline(world, SessionConfig(), TimedControls(), 5, tmp_path, deadlines=DEADLINES)
    assert files_in(tmp_path) == []
    assert world.closed_sessions == ["s0"]


async def test_an_interrupted_run_leaves_no_output(tmp_path: Path) -> None:
    world = CounterWorld(hang_at=3)
    with trio.move_on_after(0.5) as scope:
        await run_offline(world, SessionConfig(), None, 5, tmp_path, deadlines=DEADLINES)
    assert scope.cancelled_caught
    assert files_in(tmp_path) == []
    assert world.closed_sessions == ["s0"]


async def test_an_older_complete_output_is_only_replaced_by_a_complete_one(tmp_path: Path) -> None:
    await run_offline(CounterWorld(), SessionConfig(), None, 2, tmp_path, deadlines=DEADLINES)
    before = (tmp_path / "video.mp4").read_bytes(), (tmp_path / "metrics.json").read_text()
    with pytest.raises(RuntimeError):
        await run_offline(CounterWorld(fail_at=1), SessionConfig(), None, 3, tmp_path, deadlines=DEADLINES)
    assert ((tmp_path / "video.mp4").read_bytes(), (tmp_path / "metrics.json").read_text()) == before
    assert files_in(tmp_path) == ["metrics.json", "video.mp4"]


async def test_a_server_push_run_takes_no_controls(tmp_path: Path) -> None:
    from pipelines.replay import get_service as replay

    with pytest.raises(ValueError, match="server-push"):
        await run_offline(replay(), SessionConfig(), parse_timed_controls(TIMED), 2, tmp_path, deadlines=DEADLINES)
    assert files_in(tmp_path) == []


async def test_a_server_push_stream_that_ends_early(tmp_path: Path) -> None:
    from pipelines.replay import get_service as replay

    options = {"width": 32, "height": 16, "duration_seconds": 1.0}  # 2 chunks
    summary = await run_offline(replay(), SessionConfig(options=options), None, 5, tmp_path, deadlines=DEADLINES)
    assert summary.chunks == 2 and summary.metrics["ended_early"] is True


async def test_chunks_that_change_size_fail_the_run_without_output(tmp_path: Path) -> None:
    class Shrinking(CounterWorld):
        async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
            async with aclosing(super().chunks(session_id)) as inner:
                async for chunk in inner:
                    frames = chunk.frames if chunk.index == 0 else chunk.frames[:, :8]
                    yield attrs.evolve(chunk, frames=frames)

    with pytest.raises(RuntimeError, match="frame size"):
        await run_offline(Shrinking(), SessionConfig(), None, 3, tmp_path, deadlines=DEADLINES)
    assert files_in(tmp_path) == []


async def test_odd_frame_sizes_and_audio_are_written(tmp_path: Path) -> None:
    class OddWithAudio(CounterWorld):
        async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
            async with aclosing(super().chunks(session_id)) as inner:
                async for chunk in inner:
                    audio = None if chunk.index == 1 else Audio(pcm=bytes(2 * 2 * 24000), channels=2)
                    yield attrs.evolve(chunk, frames=chunk.frames[:, :15, :31], audio=audio)

    summary = await run_offline(OddWithAudio(), SessionConfig(), None, 3, tmp_path, deadlines=DEADLINES)
    assert summary.metrics["audio"] == {"sample_rate": 48000, "channels": 2, "seconds": 1.5}
    assert summary.metrics["audio_silent_chunks"] == 1  # chunk 1 had none: silence keeps the sync
    frames, kinds = decoded_video(tmp_path / "video.mp4")
    assert kinds == ["video", "audio"] and len(frames) == 12
    assert frames[0].shape == (16, 32, 3)  # padded to even for yuv420p
