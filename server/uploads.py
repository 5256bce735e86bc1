"""Uploaded reference images: one private temporary folder per server, one file per session.

A pipeline reads a session's image from a path, so an uploaded image is written to a
file that lives while its session does. The folder is made at the first upload and goes
when the server stops, with whatever is still in it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from .registry import SessionRecord

__all__ = ["UploadFolder"]


class UploadFolder:
    """The server's upload folder: ``store`` an image for a session, ``discard`` it when the session ends."""

    def __init__(self) -> None:
        self._path: str | None = None

    @property
    def path(self) -> str | None:
        """The folder, or None while nothing has been uploaded (or after :meth:`remove`)."""
        return self._path

    def store(self, record: SessionRecord, image: bytes) -> None:
        """Write ``image`` to a private file and point the session's image (and upload) path at it."""
        if self._path is None:
            self._path = tempfile.mkdtemp(prefix="chunkline-uploads-")
        handle, path = tempfile.mkstemp(prefix="upload-", suffix=".img", dir=self._path)
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
        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)
            self._path = None
