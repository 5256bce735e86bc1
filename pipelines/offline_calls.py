"""The pipeline's calls an offline run waits for, each within its deadline and named when it fails.

A run without a server has no runner to bound them: a ``running()`` that never yields or a ``create_session``
that never returns held ``chunkline run`` for ever, and an error one of them raised read ``the run failed:
KeyError: 'nope'``, naming neither the call nor whose bug it was. Here each is a :class:`PipelineCallError`
(``pipeline bug: create_session raised KeyError: 'nope'``, ``pipeline bug: create_session did not return within
60 s``). A ``ValueError`` is the pipeline refusing the request (an option it does not take) and passes unchanged,
as does a :class:`~pipelines.contract.PipelineContractError`, which names its bug already.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
import trio

from .contract import BidirectionalService, PipelineContractError, ServerPushService
from .error_text import error_line
from .loop_watch import waiting

__all__ = [
    "PipelineCallError", "RunDeadlines", "ServiceFailed", "call_within", "close_within",
    "raised_as_error", "running_within", "service_failure", "single_leaf", "telling_error",
]

T = TypeVar("T")


def _seconds(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"deadlines.{attribute.name} must be a number of seconds > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class RunDeadlines:
    """Seconds a run waits for each call of the pipeline's. No defaults here: ``chunkline run`` gives the server's
    own (:mod:`server.run_command`), so that a pipeline meets one limit whichever way it runs."""

    #: entering ``running()`` (models load and warm up there)
    running: float = attrs.field(validator=_seconds)
    #: ``create_session``, and a server-push ``stream()``'s first chunk (its session's setup)
    create_session: float = attrs.field(validator=_seconds)
    #: ``push_control``
    push_control: float = attrs.field(validator=_seconds)
    #: every other chunk the run waits for (a stream that gives none stalled: it held the run for ever)
    chunk: float = attrs.field(validator=_seconds)
    #: ``close_session`` and a stream's ``aclose``: cut past it, the run's output kept (a warning, no failure)
    close: float = attrs.field(validator=_seconds)


class PipelineCallError(PipelineContractError):
    """A call of the pipeline's raised (other than ``ValueError``) or did not return within its deadline: the
    pipeline's bug (exit code 1 under ``chunkline run``). ``call`` names it (``create_session``, ``running()``)."""

    def __init__(self, call: str, what: str) -> None:
        super().__init__(f"{call} {what}")
        self.call = call
        self.what = what

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.call, self.what)

    @classmethod
    def raised(cls, call: str, exc: BaseException, *, then: str = "") -> PipelineCallError:
        leaf = single_leaf(exc)
        return cls(call, f"raised {error_line(leaf)}{then}")

    @classmethod
    def late(cls, call: str, seconds: float) -> PipelineCallError:
        return cls(call, f"did not return within {seconds:g} s")


class ServiceFailed(RuntimeError):
    """The service said it failed as a whole (its ``failure``) and left ``running()`` with that error: a stage's
    workers died, say a rank killed from outside. Not the pipeline's bug (it read ``pipeline bug: a task running()
    started raised ServiceFailedError: ...``); the message is the service's own words."""


def single_leaf(exc: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups of one member each, else ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def telling_error(exc: BaseException, own: tuple[type[BaseException], ...]) -> BaseException:
    """The error that says why ``exc`` happened. A group of several errors (a nursery the pipeline opened in
    ``running()`` gathers the run's own error with what its tasks raised in turn, e.g. a feeding task's push to the
    session that failed) gives its first leaf of an ``own`` type, the caller's own words; failing that a
    :class:`~pipelines.contract.PipelineContractError` naming each leaf (the run read only ``ExceptionGroup:
    Exceptions from Trio nursery (2 sub-exceptions)``). A group with a cancellation or an interrupt among its
    leaves is left as it is, for whatever handles those."""
    single = single_leaf(exc)
    if not isinstance(single, BaseExceptionGroup):
        return single
    leaves = _leaves(single)
    if not all(isinstance(leaf, Exception) for leaf in leaves):
        return single
    for leaf in leaves:
        if isinstance(leaf, own):
            return leaf
    named = "; ".join(error_line(leaf) for leaf in leaves[:3])
    more = f"; and {len(leaves) - 3} more" if len(leaves) > 3 else ""
    return PipelineContractError(f"the pipeline raised {len(leaves)} errors at once: {named}{more}")


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for inner in group.exceptions:
        found.extend(_leaves(inner) if isinstance(inner, BaseExceptionGroup) else [inner])
    return found


def raised_as_error(exc: BaseException) -> bool:
    """``exc`` is an error the pipeline raised, to be named as one: an ``Exception``, or a ``BaseException`` of its
    own (``class Abort(BaseException)``), which went past every ``except Exception`` of the run and out of the command
    as a traceback. Not what steers the run: a cancellation, an interrupt, an exit, a generator's close, a group."""
    return isinstance(exc, Exception) or not isinstance(
        exc, trio.Cancelled | KeyboardInterrupt | SystemExit | GeneratorExit | BaseExceptionGroup)


def _passes(exc: BaseException, refusal: type[Exception] | None = ValueError) -> bool:
    """A refusal (``refusal``: a ``ValueError`` unless the call says which) or a contract error that names its bug
    already: not wrapped."""
    leaf = single_leaf(exc)
    return isinstance(leaf, PipelineContractError) or (refusal is not None and isinstance(leaf, refusal))


async def call_within(call: str, seconds: float, function: Callable[[], Awaitable[T]], *,
                      refusal: type[Exception] = ValueError) -> T:
    """``await function()`` within ``seconds``; past them, or when it raises anything but a ``refusal``, a
    :class:`PipelineCallError` naming ``call``. (``push_control`` refuses with a ``ControlRejected`` only: another
    ``ValueError`` out of it, a bug such as ``int('abc')``, exited 2 as bad input in its bare words.)"""
    with trio.move_on_after(seconds), waiting(call, seconds):
        try:
            return await function()
        except BaseException as exc:
            if not raised_as_error(exc) or _passes(exc, refusal):
                raise
            raise PipelineCallError.raised(call, exc) from exc
    raise PipelineCallError.late(call, seconds)


@asynccontextmanager
async def running_within(service: BidirectionalService | ServerPushService, seconds: float, *,
                         leave: tuple[float, Callable[[str], None]] | None = None) -> AsyncIterator[None]:
    """``async with service.running():``, entered within ``seconds`` (the block itself has no deadline) and, with
    ``leave`` (seconds, a callable given the warning), left within those seconds: past them leaving is cut and the
    warning said, as a close's is (a teardown that never ended held the run for ever, its complete output lost to the
    Ctrl-C that ended it). The deadline's scope spans the whole block, relaxed once inside: one exited as
    ``running()`` returns would corrupt the cancel-scope stack of a ``running()`` that opens a nursery. What entering
    or leaving it raises is named; what the block raises passes unchanged, and the one error a task ``running()``
    started raised meanwhile (its nursery's) is named as the pipeline's (it read ``the run failed: KeyError: 'k'``,
    no bug named)."""
    phase = "entering"
    block: BaseException | None = None
    try:
        with trio.CancelScope(deadline=trio.current_time() + seconds) as entering, \
                waiting("entering running()", seconds) as entered:
            async with service.running():
                entering.deadline = math.inf
                entered()
                phase = "inside"
                try:
                    yield
                except BaseException as exc:
                    block = exc
                    raise
                finally:  # leaving, whether the block ended or raised
                    if leave is not None:
                        entering.deadline = trio.current_time() + leave[0]
                phase = "leaving"
    except BaseException as exc:
        if phase == "inside":
            leaf = _task_error(exc, block)
            if leaf is None:
                raise
            if service_failure(service) is not None:  # the service's own word: it failed as a whole
                raise ServiceFailed(str(leaf) or type(leaf).__name__) from exc
            error = PipelineCallError.raised("a task running() started", leaf)
            raise error from exc
        if not raised_as_error(exc) or _passes(exc):
            raise
        raise PipelineCallError.raised("running()" if phase == "entering" else "leaving running()", exc) from exc
    if entering.cancelled_caught:
        if phase == "entering":
            raise PipelineCallError.late("running()", seconds)
        assert leave is not None  # only a leave's deadline is set once inside
        leave[1](str(PipelineCallError.late("leaving running()", leave[0])))
        if block is not None:  # the block's own error, which the cut leave had carried: it is the run's
            raise block


def service_failure(service: object) -> object | None:
    """The service's ``failure`` (why it failed as a whole), or None. A ``failure`` property that raises says the
    service is broken, in its error's words (it was taken for None: a worker served on, healthy, with no word)."""
    try:
        return getattr(service, "failure", None)
    except Exception as exc:
        return f"its failure property raised {error_line(exc)}"


def _task_error(exc: BaseException, block: BaseException | None) -> BaseException | None:
    """Where ``exc`` (out of ``running()`` while inside it) holds one error, and not one the block raised (the block
    was cancelled for it, or ended): that error, which a task ``running()`` started raised. Else None."""
    leaves = _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    errors = [leaf for leaf in leaves if raised_as_error(leaf)]
    if len(errors) != 1:
        return None
    ours = _leaves(block) if isinstance(block, BaseExceptionGroup) else [block]
    if any(errors[0] is leaf for leaf in ours) or isinstance(errors[0], PipelineContractError):
        return None
    return errors[0]


async def close_within(call: str, seconds: float, function: Callable[[], Awaitable[Any]]) -> str | None:
    """Run a close shielded (a stopped run still closes) and cut past ``seconds``: then the warning to give, else
    None. A close that raises still fails the run, named, a ``ValueError`` too: a close refuses no request (one
    exited 2 as bad input, in its bare words, after a complete run)."""
    with trio.CancelScope(shield=True), trio.move_on_after(seconds) as deadline, waiting(call, seconds):
        try:
            await function()
        except BaseException as exc:
            if not raised_as_error(exc) or _passes(exc, None):
                raise
            raise PipelineCallError.raised(call, exc) from exc
    if deadline.cancelled_caught:
        return str(PipelineCallError.late(call, seconds))
    return None
