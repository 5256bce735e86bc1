"""Files a remote client may name (only inside a directory the operator chose, never outside it), and reading any
file no further than a bound."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["NO_SUCH_FILE", "PathRefused", "open_regular_file", "read_at_most", "regular_file_problem", "resolve_inside",
           "lookup_problem"]

#: what :func:`regular_file_problem` says of a path with nothing there
NO_SUCH_FILE = "does not exist"


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
        if not resolved.exists():
            raise PathRefused("does not exist in the assets directory")
        if not resolved.is_file():
            raise PathRefused("is not a regular file in the assets directory (a directory, a pipe or a device)")
    except OSError as exc:  # a name too long for the file system: not a file there either
        raise PathRefused(f"cannot be looked up in the assets directory ({exc.strerror or 'not a file name'})") from None
    except RuntimeError:  # Python 3.11's resolve() on a loop of symbolic links
        raise PathRefused("is a loop of symbolic links in the assets directory") from None
    return resolved


def open_regular_file(path: str | os.PathLike[str]) -> int:
    """A descriptor of ``path`` for reading, only if it is a regular file and not itself a symbolic link.

    A file checked when a session was created may be swapped before it is read: for a pipe, opening and reading
    would wait for a writer for ever (in a server's event loop, every request with it); for a link, it would be
    read wherever it points. Opened without waiting (``O_NONBLOCK``) and refused by its kind, ``OSError`` naming why.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link, not the file it was") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_at_most(file: str | os.PathLike[str] | int, limit: int) -> bytes | None:
    """The bytes of ``file`` (a path, or a descriptor it then closes), or None when it holds more than ``limit``:
    read no further than that, so a huge file is not loaded to find it out. ``OSError`` as ``open`` raises it."""
    with open(file, "rb") as opened:
        data = opened.read(limit + 1)
    return None if len(data) > limit else data


def lookup_problem(path: str | os.PathLike[str], error: OSError) -> str:
    """Why looking ``path`` up failed with ``error``, in words that follow its quoted name: a symbolic link that leads
    nowhere or round in a loop was "no such file", a name too long repeated the whole name."""
    if error.errno == errno.ELOOP:
        return "is a loop of symbolic links"
    if error.errno == errno.ENAMETOOLONG:
        return "has a name too long for the file system"
    if error.errno == errno.ENOTDIR:
        return "does not exist (a part of its path is a file, not a directory)"
    if error.errno == errno.ENOENT:
        return "is a symbolic link to nothing (its target does not exist)" if os.path.islink(path) else NO_SUCH_FILE
    return f"cannot be looked up ({error.strerror or error})"


def regular_file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not a regular file (symbolic links followed), in words that follow its quoted name, or None
    when it is one: a directory, a pipe or a device is not "no such file", and is never opened to be read (a pipe
    waits for a writer for ever, ``/dev/zero`` never ends)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return lookup_problem(path, exc)
    except ValueError:  # a NUL in the name
        return "is not a file name (it holds a NUL character)"
    if stat.S_ISDIR(info.st_mode):
        return "is a directory, not a file"
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file (a pipe, a socket or a device)"
    return None
