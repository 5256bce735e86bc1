"""Uploaded reference images: one private temporary folder per server, one file per session.

A pipeline reads a session's image from a path, so an uploaded image is written to a
file that lives while its session does. The folder (a :class:`~server.server_folders.ServerFolder`:
0700, named by the server's process id, swept by the next server if this one is killed) is made at
the first upload and goes when the server stops, with whatever is still in it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from .registry import SessionRecord
from .server_folders import ServerFolder

__all__ = ["UploadFolder"]


class UploadFolder:
    """The server's upload folder: ``store`` an image for a session, ``discard`` it when the session ends."""

    def __init__(self) -> None:
        self._folder = ServerFolder("uploads")

    @property
    def path(self) -> str | None:
        """The folder, or None while nothing has been uploaded (or after :meth:`remove`)."""
        return self._folder.path

    def store(self, record: SessionRecord, image: bytes) -> None:
        """Write ``image`` to a private file and point the session's image (and upload) path at it."""
        handle, path = tempfile.mkstemp(prefix="upload-", suffix=".img", dir=self._folder.make())
        with os.fdopen(handle, "wb") as file:
            file.write(image)
        record.upload_path = record.image_path = path

    def discard(self, record: SessionRecord) -> None:
        """The session is over: its uploaded file goes (a no-op when it had none)."""
        if record.upload_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(record.upload_path)
            record.upload_path = None

    def remove(self) -> None:
        """The server stops: every session is over, so the folder goes (whatever is left in it)."""
        self._folder.remove()
