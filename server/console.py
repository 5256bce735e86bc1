"""The commands' own lines on their standard streams: a line that cannot be written is lost, and nothing else.

A stream may be closed when the command starts (``2>&-``: Python then holds ``None`` for it, and ``print(...,
file=None)`` writes to stdout instead), on a full disk (a log redirected there: ENOSPC), a terminal that went away
(EIO) or a pipe whose reader left (EPIPE). ``chunkline stream-serve`` whose stderr went to a full disk exited 1
before serving, at its "serving" line; ``chunkline run`` with stderr closed failed at its progress bar before the
run began, its message on stdout, and one whose stdout could not take the summary exited 1 saying the run failed,
its complete output left in place. Every such line goes through :func:`tell`.
"""

from __future__ import annotations

import errno
import os
import sys

__all__ = ["CLOSED", "is_broken_pipe", "tell"]

#: why a line to a stream closed since the command started was not written
CLOSED = "the stream is closed"


def tell(text: str, *, to: str = "stderr") -> str | None:
    """Write ``text`` and a newline to ``sys.stderr`` (or ``sys.stdout``: ``to="stdout"``), flushed. None when it was
    written; else why not (:data:`CLOSED`, or the error's words). A stdout that failed is pointed at the null device,
    so that what it still buffers is dropped rather than reported at the interpreter's exit."""
    stream = sys.stdout if to == "stdout" else sys.stderr
    if stream is None:
        return CLOSED
    try:
        stream.write(text + "\n")
        stream.flush()
    except (OSError, ValueError) as exc:  # ValueError: a stream closed from inside the process
        if to == "stdout":
            _drop_stdout()
        return exc.strerror or str(exc) if isinstance(exc, OSError) else CLOSED
    return None


def is_broken_pipe(why: str | None) -> bool:
    """Whether :func:`tell`'s answer is a pipe whose reader left (``| head -1``): nobody to tell."""
    return why == os.strerror(errno.EPIPE)


def _drop_stdout() -> None:
    try:
        fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):
        return
    os.dup2(devnull, fd)
    os.close(devnull)
