"""Uploaded reference images: one private temporary folder per server, one file per session.

A pipeline reads a session's image from a path, so an uploaded image is written to a
file that lives while its session does. The folder is made at the first upload and goes
when the server stops, with whatever is still in it. Its name carries the server's process
id, so a folder whose server was killed (SIGKILL skips every cleanup) is removed by the next
server's first upload.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from .registry import SessionRecord

__all__ = ["PREFIX", "UploadFolder", "remove_stale_folders"]

PREFIX = "chunkline-uploads-"


def remove_stale_folders(parent: str | None = None) -> list[str]:
    """Remove the upload folders ``PREFIX<pid>-*`` under ``parent`` (the temporary directory) whose server
    is no longer running and that belong to this user; returns what was removed."""
    removed = []
    for folder in Path(parent or tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        owner = folder.name.removeprefix(PREFIX).split("-", 1)[0]
        with contextlib.suppress(OSError):
            if owner.isdigit() and not Path(f"/proc/{owner}").exists() and folder.stat().st_uid == os.getuid():
                shutil.rmtree(folder)
                removed.append(str(folder))
    return removed


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
            remove_stale_folders()
            self._path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
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
