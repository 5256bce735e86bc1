"""The replay stream, as a pipeline that takes a reference image: for the tests of the server's upload folder, which
need a create with an uploaded image to be taken (the replay pipeline itself refuses one: it takes no image), and
load in a fraction of a second, as a torch world would not. Its stream reads the image's bytes, so that the file the
server wrote is used, and then streams the test pattern."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from pipelines.contract import Chunk, SessionConfig
from pipelines.replay import ReplayService


class ImageReplayService(ReplayService):
    takes_image = True

    def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        if config.image_path is not None:
            Path(config.image_path).read_bytes()  # the upload must be there when the stream starts
        return super().stream(config)


def get_service(gpu_num: int = 0) -> ImageReplayService:
    return ImageReplayService(gpu_num)
