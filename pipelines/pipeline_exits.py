"""A pipeline's own exits: ``sys.exit()``, a ``KeyboardInterrupt`` or a ``BaseException`` of its own, raised by one of
its calls, as the pipeline bug they are.

Such an exception is not an ``Exception``, so every ``except Exception`` that turns a pipeline's error into its
session's or worker's failure let it through, and under the server it went on up to the app: one ``sys.exit(3)`` in
``chunks()`` ended the session ``done``/``completed``, stopped the server's runtime for good (every create after it a
500, health still ``healthy``) and let the server exit 0. Here it becomes a :class:`PipelineExit`, an ``Exception``
whose words say what the pipeline did and where. trio's cancellations are not the pipeline's: those go on as they
are. A ``GeneratorExit`` is when the pipeline's own code raised it (its traceback reaches that code); one thrown into a
coroutine of chunkline's as it is closed is not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio

from .contract import PipelineContractError
from .loader import where

__all__ = ["PipelineExit", "exits_as_errors", "pipeline_exit"]


class PipelineExit(PipelineContractError):
    """A pipeline's call raised ``SystemExit``, ``KeyboardInterrupt`` or another ``BaseException`` that is not an
    ``Exception``: the pipeline's bug, which fails what it was serving (its session, or its worker)."""


def pipeline_exit(exc: BaseException, call: str = "the pipeline") -> PipelineExit | None:
    """The pipeline's own exit in ``exc`` (a group's members included) as a :class:`PipelineExit` naming ``call``;
    None when there is none (an ``Exception``, a cancellation)."""
    leaf = _exit_leaf(exc)
    if leaf is None:
        return None
    if isinstance(leaf, SystemExit):
        what = f"called sys.exit({leaf.code!r})"
    elif isinstance(leaf, KeyboardInterrupt):
        what = "raised KeyboardInterrupt (no Ctrl-C reaches a pipeline: the server takes its stop signals itself)"
    else:
        text = f": {leaf}" if str(leaf) else ""
        what = f"raised {type(leaf).__name__}{text}, a BaseException that is not an Exception"
    found = PipelineExit(f"{call} {what}{where(leaf)}")
    found.__cause__ = leaf
    return found


@contextlib.contextmanager
def exits_as_errors(call: str = "the pipeline") -> Iterator[None]:
    """Around the pipeline's ``call``: its own exit is raised as a :class:`PipelineExit`."""
    try:
        yield
    except BaseException as exc:
        found = pipeline_exit(exc, call)
        if found is None:
            raise
        raise found from exc


def _exit_leaf(exc: BaseException) -> BaseException | None:
    if isinstance(exc, BaseExceptionGroup):
        for member in exc.exceptions:
            if (leaf := _exit_leaf(member)) is not None:
                return leaf
        return None
    if isinstance(exc, Exception | trio.Cancelled) or (isinstance(exc, GeneratorExit) and not where(exc)):
        return None
    return exc
