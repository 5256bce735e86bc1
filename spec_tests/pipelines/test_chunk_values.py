"""The values an author puts in a :class:`~pipelines.contract.Chunk` and its :class:`~pipelines.contract.Audio`.

Numbers that come out of numpy (an index from an array, ``np.float32`` fps, ``np.int64`` channels) are taken as the
Python numbers they are; they were refused in words that read as a contradiction (``chunk index must be an int >= 0,
got np.int64(0)``). A bool is no index, frame rate, sample rate or channel count (``True`` was taken as 1). Audio
``pcm`` is PCM16 bytes or an int16 array: an int16 array was taken and counted by its length in samples as bytes (half
its samples, while the video file got all of them), and text, a float32 array or a fractional sample rate were taken.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipelines.contract import Audio, Chunk, InvalidChunk, ServerPushService, SessionConfig
from pipelines.offline import run_offline
from server.run_command import run_deadlines

FRAMES = np.zeros((2, 8, 8, 3), np.uint8)


def test_numpy_numbers_are_taken_as_the_python_numbers_they_are() -> None:
    chunk = Chunk(np.int64(3), FRAMES, np.float32(8.0), audio=Audio(np.zeros(4, np.int16), np.int64(48000),
                                                                    np.int32(2)))
    assert (chunk.index, chunk.fps) == (3, 8.0)
    assert type(chunk.index) is int and type(chunk.fps) is float  # JSON-ready: the server publishes them
    assert chunk.audio is not None and type(chunk.audio.sample_rate) is int and type(chunk.audio.channels) is int
    assert Audio(b"\0\0", sample_rate=48000.0).sample_rate == 48000


def test_an_int16_array_of_pcm_is_counted_by_its_samples() -> None:
    audio = Audio(np.arange(6, dtype=np.int16), channels=2)
    assert audio.samples_per_channel == 3  # it said 1: its 6 samples counted as 6 bytes
    assert audio.pcm == np.arange(6, dtype="<i2").tobytes()


@pytest.mark.parametrize(("make", "told"), [
    (lambda: Chunk(True, FRAMES, 8.0), "chunk index must be a whole number >= 0, got True"),
    (lambda: Chunk(0, FRAMES, True), "chunk fps must be a finite number > 0, got True"),
    (lambda: Chunk(0, FRAMES, 10**400), "chunk fps must be a finite number > 0, got 1000000000"),
    (lambda: Chunk(0, FRAMES, 8.0, audio=b"\0\0"), "chunk audio must be a pipelines.contract.Audio or None, got bytes"),
    (lambda: Audio("abcd"), "audio pcm must be PCM16: bytes or an int16 array, got str"),
    (lambda: Audio(np.zeros(4, np.float32)), "audio pcm must be PCM16: bytes or an int16 array, got a float32 array"),
    (lambda: Audio(b"\0\0", sample_rate=44100.5), "audio sample_rate must be a whole number > 0, got 44100.5"),
    (lambda: Audio(b"\0\0", sample_rate="48000"), "audio sample_rate must be a whole number > 0, got '48000'"),
    (lambda: Audio(b"\0\0", channels=True), "audio channels must be a whole number > 0, got True"),
], ids=["bool_index", "bool_fps", "huge_fps", "raw_audio", "text_pcm", "float_pcm", "fraction_rate", "text_rate",
        "bool_channels"])
def test_a_value_no_chunk_can_hold_is_a_pipeline_bug_naming_the_field(make: Any, told: str) -> None:
    with pytest.raises(InvalidChunk) as refused:
        make()
    assert str(refused.value).startswith(f"pipeline bug: {told}"), refused.value
    assert len(str(refused.value)) < 200


class NumpyValued(ServerPushService):
    """Chunks whose index, fps and audio come from numpy, as a model's often do."""

    takes_prompt = takes_image = False

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    async def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        for index in np.arange(3):
            audio = Audio(np.zeros(12000, np.int16), sample_rate=np.int64(48000))  # 0.25 s: the chunk's 2 frames
            yield Chunk(index, FRAMES, np.float32(8.0), audio=audio)


async def test_a_run_of_numpy_valued_chunks_writes_all_their_audio(tmp_path: Path) -> None:
    summary = await run_offline(NumpyValued(), SessionConfig(), None, 3, tmp_path, deadlines=run_deadlines())
    assert summary.chunks == 3
    assert summary.metrics["audio"]["seconds"] == pytest.approx(0.75)
