"""Offline runs: timed controls on the media clock, video.mp4 + metrics.json, and ``chunkline run``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import av
import numpy as np
import pytest
import trio

import pipelines
from pipelines.contract import (
    Audio,
    BidirectionalService,
    Chunk,
    Control,
    ControlRejected,
    ControlType,
    EventSink,
    ServiceEvent,
    SessionConfig,
)
from pipelines.offline import TimedControls, load_timed_controls, parse_timed_controls, run_offline
from pipelines.timed_controls import MAX_CONTROLS_FILE_BYTES
from server.cli import main

REPLAY = str(Path(pipelines.__file__).parent / "replay")

METRIC_KEYS = {
    "kind",
    "requested_chunks",
    "chunks",
    "frames",
    "fps",
    "width",
    "height",
    "chunk_media_seconds",
    "media_seconds",
    "wall_seconds",
    "ended_early",
    "session_setup_seconds",
    "first_output_latency_seconds",
    "chunk_period",
    "real_time_factor",
    "control_to_output_latency",
    "controls",
    "stage_times",
    "idle_reasons",
    "events",
    "audio",
}
SUMMARY_KEYS = {"count", "minimum_seconds", "p50_seconds", "p95_seconds", "maximum_seconds", "mean_seconds"}


# --- a small real world: held keys integrate into a counter drawn into every frame ------------------------


@attrs.define
class _Session:
    held: set[str] = attrs.Factory(set)
    pending: list[Control] = attrs.Factory(list)
    counter: int = 0
    started: int = 0  # chunks started so far
    prompt: str | None = None
    closed: bool = False


class CounterWorld(BidirectionalService):
    """Per chunk: apply the pushed controls, then counter += (w held) - (s held); frames show 100 + 20 * counter.

    ``reset`` releases every key, ``reset_pose`` sets the counter back to 0, a prompt containing "forbidden"
    is rejected. ``fail_at`` raises while making that chunk; ``hang_at`` never finishes it.
    """

    FPS = 8.0
    FRAMES = 4  # 0.5 s of media a chunk
    HEIGHT, WIDTH = 16, 32

    def __init__(self, fail_at: int | None = None, hang_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.hang_at = hang_at
        self.sessions: dict[str, _Session] = {}
        self.pushes: list[tuple[str, int]] = []  # (control type, chunks started when it was pushed)
        self.closed_sessions: list[str] = []
        self.is_running = False

    @asynccontextmanager
    async def running(self) -> AsyncIterator[CounterWorld]:
        self.is_running = True
        try:
            yield self
        finally:
            self.is_running = False

    async def create_session(self, config: SessionConfig, *, on_event: EventSink | None = None) -> str:
        assert self.is_running
        session_id = f"s{len(self.sessions)}"
        self.sessions[session_id] = _Session(prompt=config.prompt)
        if on_event is not None:
            on_event(ServiceEvent(session_id, "session_ready"))
        return session_id

    async def push_control(self, session_id: str, control: Control) -> None:
        session = self.sessions[session_id]
        if control.type is ControlType.PROMPT and "forbidden" in (control.prompt or ""):
            raise ControlRejected("prompt refused")
        session.pending.append(control)
        self.pushes.append((control.type.value, session.started))

    async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        session = self.sessions[session_id]
        index = 0
        while not session.closed:
            session.started += 1
            for control in session.pending:
                if control.type is ControlType.CONTROL:
                    (session.held.add if control.pressed else session.held.discard)(control.key)
                elif control.type is ControlType.CONTROL_STATE:
                    session.held = set(control.keys)
                elif control.type is ControlType.RESET:
                    session.held.clear()
                elif control.type is ControlType.RESET_POSE:
                    session.counter = 0
                elif control.type is ControlType.PROMPT:
                    session.prompt = control.prompt
            session.pending.clear()
            session.counter += ("w" in session.held) - ("s" in session.held)
            if index == self.fail_at:
                raise RuntimeError("the world fell over")
            if index == self.hang_at:
                await trio.sleep_forever()
            value = int(np.clip(100 + 20 * session.counter, 0, 255))
            yield Chunk(
                index=index,
                frames=np.full((self.FRAMES, self.HEIGHT, self.WIDTH, 3), value, dtype=np.uint8),
                fps=self.FPS,
                applied_controls={"keys": sorted(session.held), "counter": session.counter},
                metadata={"stage_times": {"step": 0.002, "draw": {"seconds": 0.001}}, "idle_reasons": ["continuous"]},
            )
            index += 1
            await trio.lowlevel.checkpoint()

    async def close_session(self, session_id: str) -> None:
        self.sessions[session_id].closed = True
        self.closed_sessions.append(session_id)


def get_service(gpu_num: int = 0) -> CounterWorld:  # lets the test's pipeline files load it
    return CounterWorld()


def decoded_video(path: Path) -> tuple[list[np.ndarray], list[str]]:
    with av.open(str(path)) as container:
        kinds = [s.type for s in container.streams]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return frames, kinds


def files_in(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


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

TIMED = [
    {"t": 0, "type": "control", "control": "ArrowUp", "event": "press"},  # chunk 0 (starts at 0.0)
    {"t": 0.7, "type": "control", "control": "KeyW", "event": "release"},  # chunk 2 (1.0), not chunk 1 (0.5)
    {"t": 1.5, "type": "control_state", "controls": ["backward"]},  # chunk 3, starting exactly at 1.5
    {"t": 1.6, "type": "prompt", "prompt": "a snowy street"},  # chunk 4
    {"t": 1.7, "type": "prompt", "prompt": "forbidden words"},  # chunk 4, rejected by the service
    {"t": 2.5, "type": "reset"},  # chunk 5
    {"t": 2.9, "type": "control", "control": "forward", "event": "press"},  # chunk 6
    {"t": 3.5, "type": "reset_pose"},  # chunk 7
    {"t": 99, "type": "reset"},  # after the last chunk: never pushed
]
# counter after each chunk: +1, +1, 0 (released), -1 (s held), -1, 0 (reset), +1, reset to 0 then +1
EXPECTED_COUNTERS = [1, 2, 2, 1, 0, 0, 1, 1]


async def test_controls_apply_to_the_right_chunk_on_the_media_clock(tmp_path: Path) -> None:
    world = CounterWorld()
    done: list[tuple[int, int]] = []
    summary = await run_offline(
        world, SessionConfig(prompt="a street"), parse_timed_controls(TIMED), 8, tmp_path, progress=lambda d, t: done.append((d, t))
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

    summary = await run_offline(Plain(), SessionConfig(), None, 2, tmp_path / "new" / "dir")
    assert summary.chunks == 2 and summary.video_path == tmp_path / "new" / "dir" / "video.mp4"
    assert summary.metrics["stage_times"] == {} and summary.metrics["idle_reasons"] == {}
    assert summary.metrics["control_to_output_latency"]["count"] == 0


async def test_a_failed_run_leaves_no_output(tmp_path: Path) -> None:
    world = CounterWorld(fail_at=2)
    with pytest.raises(RuntimeError, match="fell over"):
        await run_offline(world, SessionConfig(), TimedControls(), 5, tmp_path)
    assert files_in(tmp_path) == []
    assert world.closed_sessions == ["s0"]


async def test_an_interrupted_run_leaves_no_output(tmp_path: Path) -> None:
    world = CounterWorld(hang_at=3)
    with trio.move_on_after(0.5) as scope:
        await run_offline(world, SessionConfig(), None, 5, tmp_path)
    assert scope.cancelled_caught
    assert files_in(tmp_path) == []
    assert world.closed_sessions == ["s0"]


async def test_an_older_complete_output_is_only_replaced_by_a_complete_one(tmp_path: Path) -> None:
    await run_offline(CounterWorld(), SessionConfig(), None, 2, tmp_path)
    before = (tmp_path / "video.mp4").read_bytes(), (tmp_path / "metrics.json").read_text()
    with pytest.raises(RuntimeError):
        await run_offline(CounterWorld(fail_at=1), SessionConfig(), None, 3, tmp_path)
    assert ((tmp_path / "video.mp4").read_bytes(), (tmp_path / "metrics.json").read_text()) == before
    assert files_in(tmp_path) == ["metrics.json", "video.mp4"]


async def test_a_server_push_run_takes_no_controls(tmp_path: Path) -> None:
    from pipelines.replay import get_service as replay

    with pytest.raises(ValueError, match="server-push"):
        await run_offline(replay(), SessionConfig(), parse_timed_controls(TIMED), 2, tmp_path)
    assert files_in(tmp_path) == []


async def test_a_server_push_stream_that_ends_early(tmp_path: Path) -> None:
    from pipelines.replay import get_service as replay

    options = {"width": 32, "height": 16, "duration_seconds": 1.0}  # 2 chunks
    summary = await run_offline(replay(), SessionConfig(options=options), None, 5, tmp_path)
    assert summary.chunks == 2 and summary.metrics["ended_early"] is True


# --- chunkline run ------------------------------------------------------------------------------------------


def test_chunkline_run_replay_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["run", REPLAY, "--chunks", "3", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    # stderr is no terminal here: progress comes as plain lines (a bar redrawn per chunk filled logs)
    assert "3/3 chunks" in captured.err and "\r" not in captured.err
    assert "real-time factor" in captured.out and str(out / "video.mp4") in captured.out
    assert files_in(out) == ["metrics.json", "video.mp4"]

    frames, kinds = decoded_video(out / "video.mp4")
    assert len(frames) == 3 * 8  # frames_per_chunk defaults to 8
    assert frames[0].shape == (192, 320, 3)
    assert "audio" in kinds
    with av.open(str(out / "video.mp4")) as container:
        assert container.streams.video[0].codec_context.name == "h264"
        assert container.streams.video[0].format.name == "yuv420p"
        audio = container.streams.audio[0]
        assert (audio.codec_context.name, audio.sample_rate) == ("aac", 48000)
        assert sum(f.samples for f in container.decode(audio=0)) >= 3 * 24000

    metrics = json.loads((out / "metrics.json").read_text())
    assert METRIC_KEYS <= set(metrics)
    assert metrics["kind"] == "server_push"
    assert (metrics["chunks"], metrics["frames"], metrics["media_seconds"]) == (3, 24, 1.5)
    assert metrics["audio"] == {"sample_rate": 48000, "channels": 1, "seconds": 1.5}
    assert set(metrics["chunk_period"]) == SUMMARY_KEYS and metrics["chunk_period"]["count"] == 2
    assert metrics["real_time_factor"] > 0


def write_counter_pipeline(tmp_path: Path, signature: str = "gpu_num=0") -> str:
    path = tmp_path / "counter_pipeline.py"
    path.write_text(
        "from spec_tests.pipelines.test_offline_run import CounterWorld\n\n"
        f"def get_service({signature}):\n"
        "    return CounterWorld()\n"
    )
    return str(path)


def test_the_progress_bar_is_drawn_on_a_terminal(tmp_path: Path) -> None:
    """``chunkline run`` with its stderr on a terminal (a pty): the bar, redrawn in place."""
    terminal, its_other_end = os.openpty()
    try:
        done = subprocess.run([sys.executable, "-m", "server.cli", "run", REPLAY, "--chunks", "3", "--out",
                               str(tmp_path / "out")], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=its_other_end, timeout=300, cwd=Path(pipelines.__file__).parents[1])
        os.close(its_other_end)
        shown = b""
        while True:
            try:
                piece = os.read(terminal, 65536)
            except OSError:  # EIO: the writer's end is closed and everything was read
                break
            if not piece:
                break
            shown += piece
    finally:
        os.close(terminal)
    assert done.returncode == 0, shown
    assert b"\r[" in shown and b"3/3 chunks" in shown, shown


def test_chunkline_run_with_controls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    controls = tmp_path / "controls.json"
    controls.write_text(json.dumps(TIMED))
    image = tmp_path / "ref.png"
    image.write_bytes(b"not really a png; the counter world ignores it")
    pipeline = write_counter_pipeline(tmp_path, "gpu_num=0, seed=None")
    out = tmp_path / "out"
    args = ["run", pipeline, "--controls", str(controls), "--chunks", "8", "--out", str(out)]
    assert main([*args, "--seed", "3", "--prompt", "a street", "--image", str(image)]) == 0
    frames, _ = decoded_video(out / "video.mp4")
    means = [float(np.mean(frames[i * 4 : i * 4 + 4])) for i in range(8)]
    assert means == pytest.approx([100 + 20 * c for c in EXPECTED_COUNTERS], abs=4)
    assert "7 pushed, 1 rejected, 1 not reached" in capsys.readouterr().out


def sparse_file(path: Path, size: int) -> str:
    """A file of ``size`` bytes that takes no room on disk (a hole)."""
    with path.open("wb") as file:
        file.truncate(size)
    return str(path)


def bad_controls(tmp_path: Path, content: str) -> str:
    path = tmp_path / f"controls{len(list(tmp_path.glob('controls*.json')))}.json"
    path.write_text(content)
    return str(path)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing_pipeline", "does not exist"),
        ("missing_image", "--image: no such file"),
        ("missing_controls", "--controls: no such file"),
        ("malformed_controls", "not valid JSON"),
        ("unknown_control", "controls entry 1: unknown control 'jump'"),
        ("cuda_unavailable", "no CUDA device"),
        ("bad_option", "replay option 'fps'"),
        ("controls_for_server_push", "takes no --controls"),
        ("seed_not_accepted", "does not accept ['seed']"),
        ("zero_chunks", "--chunks must be >= 1"),
        ("bad_option_syntax", "is not KEY=VALUE"),
        # one prompt rule everywhere (a create and a room take at most 2000 characters of encodable text)
        ("long_prompt", "--prompt is 2001 characters; at most 2000"),
        ("long_prompt_in_controls", "controls entry 0: 'prompt' is 2001 characters; at most 2000"),
        ("lone_surrogate_in_controls", "a string holds a lone surrogate"),
        ("undecodable_prompt", "--prompt is not valid text"),  # argv bytes that are not UTF-8 (surrogateescape)
        ("duplicate_key_in_controls", "key 't' appears twice in one object"),
        ("deeply_nested_controls", "JSON nested 100000 levels deep; at most 32"),
        ("huge_controls", "is larger than 16 MiB, the most a run reads"),  # read whole first: 20 x its size
    ],
)
def test_bad_input_exits_2_and_writes_nothing(
    case: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    reset_then = '[{"t": 0, "type": "reset"}, {"t": 1, "type": "control", "control": "jump", "event": "press"}]'
    args = {
        "missing_pipeline": ["run", str(tmp_path / "nope.py")],
        "missing_image": ["run", REPLAY, "--image", str(tmp_path / "nope.png")],
        "missing_controls": ["run", REPLAY, "--controls", str(tmp_path / "nope.json")],
        "malformed_controls": ["run", REPLAY, "--controls", bad_controls(tmp_path, "[{")],
        "unknown_control": ["run", REPLAY, "--controls", bad_controls(tmp_path, reset_then)],
        "cuda_unavailable": ["run", REPLAY, "--device", "cuda"],
        "bad_option": ["run", REPLAY, "--option", "fps=0"],
        "controls_for_server_push": ["run", REPLAY, "--controls", bad_controls(tmp_path, '[{"t": 0, "type": "reset"}]')],
        "seed_not_accepted": ["run", write_counter_pipeline(tmp_path), "--seed", "3"],
        "zero_chunks": ["run", REPLAY, "--chunks", "0"],
        "bad_option_syntax": ["run", REPLAY, "--option", "fps"],
        "long_prompt": ["run", REPLAY, "--prompt", "x" * 2001],
        "undecodable_prompt": ["run", REPLAY, "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")],
        "long_prompt_in_controls": ["run", REPLAY, "--controls", bad_controls(tmp_path, json.dumps(
            [{"t": 0, "type": "prompt", "prompt": "x" * 2001}]))],
        "lone_surrogate_in_controls": ["run", REPLAY, "--controls", bad_controls(
            tmp_path, '[{"t": 0, "type": "prompt", "prompt": "\\ud800"}]')],
        "duplicate_key_in_controls": ["run", REPLAY, "--controls", bad_controls(
            tmp_path, '[{"t": 0, "t": 1, "type": "reset"}]')],
        "deeply_nested_controls": ["run", REPLAY, "--controls", bad_controls(tmp_path, "[" * 100_000 + "]" * 100_000)],
        "huge_controls": ["run", REPLAY, "--controls", sparse_file(tmp_path / "huge.json", MAX_CONTROLS_FILE_BYTES + 1)],
    }[case]
    if case == "cuda_unavailable":
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if "--chunks" not in args:
        args += ["--chunks", "2"]
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert not (out / "video.mp4").exists()
    assert files_in(out) == []
    assert not out.exists()


async def test_chunks_that_change_size_fail_the_run_without_output(tmp_path: Path) -> None:
    class Shrinking(CounterWorld):
        async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
            async with aclosing(super().chunks(session_id)) as inner:
                async for chunk in inner:
                    frames = chunk.frames if chunk.index == 0 else chunk.frames[:, :8]
                    yield attrs.evolve(chunk, frames=frames)

    with pytest.raises(RuntimeError, match="frame size"):
        await run_offline(Shrinking(), SessionConfig(), None, 3, tmp_path)
    assert files_in(tmp_path) == []


async def test_odd_frame_sizes_and_audio_are_written(tmp_path: Path) -> None:
    class OddWithAudio(CounterWorld):
        async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
            async with aclosing(super().chunks(session_id)) as inner:
                async for chunk in inner:
                    audio = None if chunk.index == 1 else Audio(pcm=bytes(2 * 2 * 24000), channels=2)
                    yield attrs.evolve(chunk, frames=chunk.frames[:, :15, :31], audio=audio)

    summary = await run_offline(OddWithAudio(), SessionConfig(), None, 3, tmp_path)
    assert summary.metrics["audio"] == {"sample_rate": 48000, "channels": 2, "seconds": 1.5}
    assert summary.metrics["audio_silent_chunks"] == 1  # chunk 1 had none: silence keeps the sync
    frames, kinds = decoded_video(tmp_path / "video.mp4")
    assert kinds == ["video", "audio"] and len(frames) == 12
    assert frames[0].shape == (16, 32, 3)  # padded to even for yuv420p
