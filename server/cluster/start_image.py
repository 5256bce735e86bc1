"""The reference image a Start carries to an agent: read from the session's upload, within the server's limit.
Split from :mod:`server.cluster.remote`."""

from __future__ import annotations

import base64
from pathlib import Path

from pipelines.paths import open_regular_file, read_at_most

__all__ = ["MAX_IMAGE_BYTES", "read_image"]

MAX_IMAGE_BYTES = 8 * 1024 * 1024


def read_image(path: str | None) -> tuple[str | None, str | None]:
    """The image as a Start carries it (base64) and its file suffix; (None, None) for a session without one.
    ValueError names the image when it cannot be read or is over :data:`MAX_IMAGE_BYTES`."""
    if path is None:
        return None, None
    name = Path(path).name  # the client named it; the server's folders are not the client's business
    try:  # a pipe swapped in would hold the event loop: a regular file only
        data = read_at_most(open_regular_file(path), MAX_IMAGE_BYTES)
    except OSError as exc:
        raise ValueError(f"the reference image {name!r} cannot be read: {exc.strerror or exc}") from None
    if data is None:
        raise ValueError(f"the reference image {name!r} is larger than {MAX_IMAGE_BYTES} bytes")
    return base64.b64encode(data).decode(), Path(path).suffix or None
