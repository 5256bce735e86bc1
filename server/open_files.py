"""How many client connections the process's open-file limit lets the front serve.

Each HTTP request under way holds three descriptors (the client's socket, the front's to hypercorn, hypercorn's end
of it). Under a soft limit of 1,024, a common default, a few hundred slow clients used every descriptor below the
front's 1,024-connection cap: the cap never acted, ``accept`` failed with ``EMFILE`` ten times a second (a traceback
each) and every other client waited unanswered. So the server raises its soft limit towards its hard limit at start
(as far as the cap needs), and where the hard limit is lower still, serves fewer connections, said at start: past
them a client is answered 503 ``too_many_connections`` as past the cap.
"""

from __future__ import annotations

import resource
from typing import Final

__all__ = ["DESCRIPTORS_PER_CONNECTION", "RESERVED_DESCRIPTORS", "connection_cap", "raise_open_files_limit"]

DESCRIPTORS_PER_CONNECTION: Final = 3
#: descriptors kept for all else: the interpreter, its libraries, workers' pipes and shared memory, log files
RESERVED_DESCRIPTORS: Final = 256


def connection_cap(most: int, open_files: int) -> int:
    """The connections the front serves at once: ``most``, or fewer where ``open_files`` (the soft limit) cannot
    hold them beside the reserve (at least one)."""
    return max(1, min(most, (open_files - RESERVED_DESCRIPTORS) // DESCRIPTORS_PER_CONNECTION))


def raise_open_files_limit(connections: int) -> int:
    """Raise the soft open-file limit to what ``connections`` need, up to the hard limit; returns the soft limit now
    (unchanged where it was enough, or where the system refuses; ``wanted`` where there is no limit)."""
    wanted = RESERVED_DESCRIPTORS + DESCRIPTORS_PER_CONNECTION * connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    if soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    return soft
