"""Where tensor channels' shared memory lives and how it is named: for the processes that make channels and for
those that only clean up after them (a server whose process workers it reaps), which must not import torch.

A segment is ``/dev/shm/cl_<pid>-<pid namespace>-<random id>_<part>``: the pid of the process that made the
channel and the pid namespace it is a pid of, so that a later process can tell the segments of one that is gone
(killed before it could unlink them). A process in another pid namespace sharing /dev/shm (containers of one pod,
``docker --ipc=host``) cannot see that pid: one took a live channel's segments for a dead one's, and unlinked them.
"""

from __future__ import annotations

import os
from collections.abc import Callable

try:  # the primitive multiprocessing.shared_memory is built on
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

__all__ = [
    "SEGMENT_PREFIX", "SHM_DIRECTORY", "channel_owner", "remove_segments_of", "remove_stale_segments", "segment_prefix",
    "unlink",
]


def unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


SHM_DIRECTORY = "/dev/shm"
SEGMENT_PREFIX = "cl_"  # then the creating process's pid, "-" and the channel's random id
_swept: list[bool] = []  # whether this process has looked for stale segments already


def segment_prefix(channel_id: str) -> str:
    return f"{SEGMENT_PREFIX}{channel_id}_"


def pid_namespace() -> str:
    """This process's pid namespace, as the inode number of ``/proc/self/ns/pid`` ("0" where it cannot be read)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def channel_owner() -> str:
    """The start of a new channel's id: this process's pid and its pid namespace (``<pid>-<namespace>``)."""
    return f"{os.getpid()}-{pid_namespace()}"


def remove_stale_segments(directory: str = SHM_DIRECTORY) -> list[str]:
    """Unlink the segments of channels whose creating process is gone and that belong to this user (once per
    process: a process killed with SIGKILL, or one that ended with ``os._exit``, unlinked none of its own);
    returns what was removed."""
    if _swept:
        return []
    _swept.append(True)

    def stale(name: str, owner: str) -> bool:  # its process is gone (a pid taken again is left alone)
        return not os.path.exists(f"/proc/{owner}") and os.stat(os.path.join(directory, name)).st_uid == os.getuid()

    return _unlink_where(directory, stale)


def remove_segments_of(pid: int, directory: str = SHM_DIRECTORY) -> list[str]:
    """Unlink every segment of the channels process ``pid`` created: for its parent, once it has reaped it (a
    child killed with SIGKILL left them until the next process that made a channel swept them)."""
    return _unlink_where(directory, lambda name, owner: owner == str(pid))


def _unlink_where(directory: str, chosen: Callable[[str, str], bool]) -> list[str]:
    """Unlink the channel segments in ``directory`` that ``chosen(name, owner pid)`` picks; returns their names."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    here = pid_namespace()
    for name in names:
        parts = name.removeprefix(SEGMENT_PREFIX).split("-", 2) if name.startswith(SEGMENT_PREFIX) else []
        owner = parts[0] if len(parts) == 3 and parts[1] == here else ""  # a pid of another namespace is not ours
        if not (owner.isascii() and owner.isdigit()):
            continue  # not a channel's segment named by its maker in this pid namespace
        try:
            if chosen(name, owner):
                unlink(name)
                removed.append(name)
        except OSError:  # gone meanwhile
            continue
    return removed
