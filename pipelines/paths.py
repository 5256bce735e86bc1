"""Files a remote client may name (only inside a directory the operator chose, never outside it), and reading any
file no further than a bound."""

from __future__ import annotations

import errno
import os
import stat
import unicodedata
from pathlib import Path

__all__ = ["NO_SUCH_FILE", "PathRefused", "open_regular_file", "read_at_most", "regular_file_problem", "resolve_inside",
           "lookup_problem", "relative_name_problem"]

#: what :func:`regular_file_problem` says of a path with nothing there
NO_SUCH_FILE = "does not exist"

#: the longest name of one file or folder (bytes, as UTF-8) and of a whole path that Linux's file systems take
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4095


class PathRefused(ValueError):
    """A client-named path that is not a file inside its directory; the message says why (the caller names the
    path, bounded, as it names the field: the message never repeats it)."""


def relative_name_problem(name: str) -> str | None:
    """Why ``name`` is not the form of a file's path relative to a directory, in words that follow its quoted name,
    or None when it is one. Read before the file system is asked, so that each bad form is told as what it is: a NUL
    was "must be relative", and ``a.png/`` or ``a.png/.`` (a folder's form) named the file ``a.png`` because
    :class:`~pathlib.Path` drops a trailing ``/`` and ``.`` where the system would refuse them."""
    if not name:
        return "is empty; name a file inside the assets directory"
    if "\x00" in name:
        return f"holds a NUL character (at character {name.index(chr(0))}), which no file name can hold"
    control = next((i for i, c in enumerate(name) if unicodedata.category(c) == "Cc"), None)
    if control is not None:
        return f"holds a control character ({ord(name[control]):#04x}) at character {control}"
    if "\\" in name:
        return f"holds a backslash (at character {name.index(chr(92))}); the parts of a path are separated by '/'"
    if name.startswith("/"):
        return "must be relative to the assets directory (it starts with '/')"
    parts = name.split("/")
    if ".." in parts:
        return "may not contain '..'"
    if parts[-1] in ("", "."):
        if all(part in ("", ".") for part in parts):
            return "names the assets directory itself, not a file in it"
        return f"ends with {'/' if parts[-1] == '' else '/.'!r}, the form of a folder; name a file (without it)"
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_PATH_BYTES:
        return f"is {size} bytes long; a path is at most {MAX_PATH_BYTES}"
    longest = max(parts, key=lambda part: len(part.encode("utf-8", "surrogatepass")))
    size = len(longest.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        return f"has a part of {size} bytes; a file or folder name is at most {MAX_NAME_BYTES}"
    return None


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, for a refusal."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a file"


def resolve_inside(root: str | os.PathLike[str], name: str) -> Path:
    """``name`` resolved inside ``root``: the form of a relative file path (:func:`relative_name_problem`), no
    symlinks out, and a regular file there; :class:`PathRefused` says why not."""
    problem = relative_name_problem(name)
    if problem is not None:
        raise PathRefused(problem)
    base = Path(root).resolve()
    try:
        resolved = (base / name).resolve()
        if not resolved.is_relative_to(base):
            raise PathRefused("resolves outside the assets directory")
        if not resolved.exists():
            raise PathRefused("does not exist in the assets directory")
        mode = resolved.stat().st_mode
        if not stat.S_ISREG(mode):
            raise PathRefused(f"is {_kind(mode)} in the assets directory, not a regular file")
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
