"""Files a remote client may name: only inside a directory the operator chose, never outside it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PathRefused", "resolve_inside"]


class PathRefused(ValueError):
    """A client-named path that is not a file inside its directory; the message says why (the caller names the
    path, bounded, as it names the field: the message never repeats it)."""


def resolve_inside(root: str | os.PathLike[str], name: str) -> Path:
    """``name`` resolved inside ``root``: no absolute paths, no ``..``, no symlinks out, and a file there."""
    if os.path.isabs(name) or "\\" in name or "\x00" in name:
        raise PathRefused("must be relative to the assets directory")
    if ".." in Path(name).parts:
        raise PathRefused("may not contain '..'")
    base = Path(root).resolve()
    try:
        resolved = (base / name).resolve()
        if not resolved.is_relative_to(base):
            raise PathRefused("resolves outside the assets directory")
        if not resolved.is_file():
            raise PathRefused("does not exist in the assets directory")
    except OSError as exc:  # a name too long for the file system, a loop of links: not a file there either
        raise PathRefused(f"cannot be looked up in the assets directory ({exc.strerror or 'not a file name'})") from None
    return resolved
