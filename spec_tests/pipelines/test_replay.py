"""pipelines/replay: a server-push service streaming a test pattern or a video file, with a tone."""

from __future__ import annotations

from fractions import Fraction
from itertools import pairwise
from pathlib import Path

import av
import numpy as np
import pytest

import pipelines
from pipelines.contract import Chunk, ServerPushService, SessionConfig
from pipelines.loader import PipelineLoadError, load_service
from pipelines.replay import ReplayService, get_service
from pipelines.replay.service import SAMPLE_RATE, render_test_pattern, tone_pcm

REPLAY = Path(pipelines.__file__).parent / "replay"
SMALL = {"width": 32, "height": 16, "fps": 16, "frames_per_chunk": 4, "duration_seconds": 1.0}


async def collect(service: ServerPushService, **options: object) -> list[Chunk]:
    async with service.running():
        return [chunk async for chunk in service.stream(SessionConfig(options=options))]


def counter_region(frame: np.ndarray) -> np.ndarray:
    # scale 1 at height < 96: a 1-pixel pad, 4 glyphs of 3x5 with 1-pixel gaps
    return frame[:7, :17]


def test_get_service_fits_the_contract() -> None:
    service = load_service(REPLAY, gpu_num=0)
    assert isinstance(service, ServerPushService)
    assert service.kind == "server_push"
    assert isinstance(get_service(gpu_num=1), ReplayService)  # it uses no accelerator: any gpu_num
    with pytest.raises(PipelineLoadError, match=r"does not accept \['device', 'seed'\]"):
        load_service(REPLAY, device="cpu", seed=3)  # it has neither: refused, not ignored


async def test_chunks_are_well_formed_with_one_chunk_of_audio_each() -> None:
    chunks = await collect(get_service(), **SMALL)
    assert [c.index for c in chunks] == [0, 1, 2, 3]  # 1 s at 16 fps, 4 frames a chunk
    for chunk in chunks:
        assert chunk.frames.shape == (4, 16, 32, 3)
        assert chunk.frames.dtype == np.uint8
        assert chunk.fps == 16
        assert chunk.audio is not None
        assert (chunk.audio.sample_rate, chunk.audio.channels) == (SAMPLE_RATE, 1)
        assert chunk.audio.samples_per_channel == 4 * SAMPLE_RATE // 16  # exactly the chunk's media duration
        assert chunk.metadata["source"] == "test_pattern"
    # the tone runs on across chunks without a phase jump
    pcm = b"".join(c.audio.pcm for c in chunks if c.audio is not None)
    assert pcm == tone_pcm(0, 16, 16.0, 440.0)
    samples = np.frombuffer(pcm, dtype="<i2")
    assert samples.max() > 5000 and samples.min() < -5000


async def test_audio_length_never_drifts_when_a_chunk_is_not_a_whole_number_of_samples() -> None:
    chunks = await collect(get_service(), width=32, height=16, fps=30, frames_per_chunk=7, duration_seconds=1.0)
    assert len(chunks) == 5  # ceil(30 / 7)
    lengths = [c.audio.samples_per_channel for c in chunks if c.audio is not None]
    exact = Fraction(7 * SAMPLE_RATE, 30)  # 11200 exactly here; check the running total anyway
    assert all(abs(n - exact) <= 1 for n in lengths)
    assert sum(lengths) == round(35 * SAMPLE_RATE / 30)


async def test_silent_tone() -> None:
    chunks = await collect(get_service(), **SMALL, tone_hz=0)
    assert all(c.audio is not None and not any(c.audio.pcm) for c in chunks)


async def test_frame_counter_and_pattern_change_every_frame() -> None:
    chunks = await collect(get_service(), **SMALL)
    frames = np.concatenate([c.frames for c in chunks])
    assert len(frames) == 16
    regions = [counter_region(f) for f in frames]
    for earlier, later in pairwise(regions):
        assert not np.array_equal(earlier, later)  # across chunk boundaries too
    assert set(np.unique(regions[0])) == {0, 255}  # white block digits on black
    for earlier, later in pairwise(frames):
        assert not np.array_equal(earlier, later)
    # deterministic: the same frame number renders the same image
    assert np.array_equal(frames[5], render_test_pattern(5, 32, 16, 16.0))


async def test_the_stream_is_bounded_by_duration() -> None:
    chunks = await collect(get_service(), width=32, height=16, fps=16, frames_per_chunk=8, duration_seconds=1.2)
    assert len(chunks) == 3  # ceil(1.2 * 16 / 8)
    assert all(c.frame_count == 8 for c in chunks)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"fps": 0}, "fps"),
        ({"fps": "16"}, "fps"),
        ({"fps": True}, "fps"),
        ({"width": 33}, "width"),
        ({"width": 16.0}, "width"),
        ({"height": 8}, "height"),
        ({"frames_per_chunk": 0}, "frames_per_chunk"),
        ({"duration_seconds": -1}, "duration_seconds"),
        ({"duration_seconds": float("inf")}, "duration_seconds"),
        ({"tone_hz": 30000}, "tone_hz"),
        ({"video_path": "/no/such/video.mp4"}, "video_path"),
        ({"video_path": 7}, "video_path"),
        ({"colour": "red"}, "colour"),
    ],
)
async def test_option_validation_names_the_option(options: dict[str, object], named: str) -> None:
    service = get_service()
    async with service.running():
        with pytest.raises(ValueError, match=named):
            service.stream(SessionConfig(options=options))
        # a refused request does not hold the one session
        await service.stream(SessionConfig(options=SMALL)).aclose()


async def test_a_file_that_is_not_a_video_is_refused(tmp_path: Path) -> None:
    bogus = tmp_path / "notes.mp4"
    bogus.write_text("not a video")
    service = get_service()
    async with service.running():
        with pytest.raises(ValueError, match="video_path"):
            service.stream(SessionConfig(options={"video_path": str(bogus)}))


async def test_exactly_one_session_at_a_time() -> None:
    service = get_service()
    with pytest.raises(RuntimeError, match="running"):
        service.stream(SessionConfig(options=SMALL))
    async with service.running():
        first = service.stream(SessionConfig(options=SMALL))
        with pytest.raises(RuntimeError, match="one stream at a time"):
            service.stream(SessionConfig(options=SMALL))
        assert (await first.__anext__()).index == 0
        await first.aclose()  # closing frees it, even mid-stream
        second = service.stream(SessionConfig(options=SMALL))
        assert len([c async for c in second]) == 4  # exhausting frees it too
        third = service.stream(SessionConfig(options=SMALL))
        await third.aclose()  # and so does closing a stream that never started


def write_video(path: Path, colours: list[int], fps: int = 10, size: tuple[int, int] = (48, 32)) -> None:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i, value in enumerate(colours):
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), value, np.uint8), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


async def test_replays_a_video_file_resized_and_ends_with_it(tmp_path: Path) -> None:
    video = tmp_path / "clip.mp4"
    colours = [20 * i + 20 for i in range(10)]  # 1 s at 10 fps
    write_video(video, colours)
    chunks = await collect(
        get_service(), video_path=str(video), fps=10, width=16, height=16, frames_per_chunk=4, duration_seconds=5
    )
    assert [c.frame_count for c in chunks] == [4, 4, 2]  # the video ends before the duration does
    for chunk in chunks:
        assert chunk.frames.shape[1:] == (16, 16, 3)
        assert chunk.metadata["source"] == "video"
        assert chunk.audio is not None and chunk.audio.samples_per_channel == chunk.frame_count * SAMPLE_RATE // 10
    means = [float(f.mean()) for c in chunks for f in c.frames]
    assert means == pytest.approx(colours, abs=6)


async def test_video_is_sampled_at_the_requested_fps(tmp_path: Path) -> None:
    video = tmp_path / "clip.mp4"
    colours = [20 * i + 20 for i in range(10)]
    write_video(video, colours)
    chunks = await collect(get_service(), video_path=str(video), fps=5, width=16, height=16, frames_per_chunk=5)
    means = [float(f.mean()) for c in chunks for f in c.frames]
    assert means == pytest.approx(colours[::2], abs=6)  # every other source frame
