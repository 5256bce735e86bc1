"""The folders a server (or a worker agent) keeps on disk: private to its user, named by its process id, gone when
it stops.

Each is ``<temporary directory>/chunkline-<kind>-<pid>-<random>``, made mode 0700 (``tempfile.mkdtemp``), so
no other user can read what is inside or connect to a socket there: the uploaded images
(:mod:`server.uploads`) and the Unix socket hypercorn listens on behind the front (:mod:`server.serve`). Every
exit the server controls removes them (a stop, SIGTERM or SIGINT, the drain's watchdog, a second signal);
what a killed server left (SIGKILL skips every cleanup) is removed by the next server as it makes one of its
own, once no process has that id and the folder is this user's. A running server's folders are never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Final

__all__ = ["KINDS", "ServerFolder", "folder_prefix", "remove_stale_folders"]

#: what a server keeps on disk, one folder of each (made when first needed); ``agent``: a worker agent's copies
#: of its sessions' images; ``launcher``: where the local launcher's agents tell a failed load, ``ray``: the same
#: for the agent a Ray actor runs (a SIGKILL left them, unnamed by a process id, for good)
KINDS: Final = ("uploads", "front", "agent", "launcher", "ray")


def folder_prefix(kind: str) -> str:
    return f"chunkline-{kind}-"


def remove_stale_folders(parent: str | None = None) -> list[str]:
    """Remove the folders ``chunkline-<kind>-<pid>-*`` under ``parent`` (the temporary directory) whose server
    is no longer running and that belong to this user; returns what was removed."""
    removed = []
    for kind in KINDS:
        for folder in Path(parent or tempfile.gettempdir()).glob(f"{folder_prefix(kind)}*-*"):
            owner = folder.name.removeprefix(folder_prefix(kind)).split("-", 1)[0]
            with contextlib.suppress(OSError):
                if owner.isdigit() and not Path(f"/proc/{owner}").exists() and folder.stat().st_uid == os.getuid():
                    shutil.rmtree(folder)
                    removed.append(str(folder))
    return removed


class ServerFolder:
    """One of this server's folders (``kind``, one of :data:`KINDS`): :meth:`make` it, :meth:`remove` it."""

    def __init__(self, kind: str) -> None:
        assert kind in KINDS, kind
        self.kind = kind
        self._path: str | None = None

    @property
    def path(self) -> str | None:
        """The folder, or None before :meth:`make` (and after :meth:`remove`)."""
        return self._path

    def make(self) -> str:
        """The folder, made (0700) the first time, after the folders killed servers left are removed, and made
        again when it went meanwhile: a temporary-file cleaner (systemd-tmpfiles) removes a folder left idle for
        days, and every later image then failed (a worker agent crashed on it, every session it ran lost)."""
        if self._path is None or not _own_folder(self._path):
            remove_stale_folders()
            self._path = tempfile.mkdtemp(prefix=f"{folder_prefix(self.kind)}{os.getpid()}-")
        return self._path

    def remove(self) -> None:
        """The folder goes, with whatever is in it (a no-op when it was never made)."""
        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)
            self._path = None


def _own_folder(path: str) -> bool:
    """Whether ``path`` is still a folder of this user's (not gone, and not something else put in its place)."""
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid()
