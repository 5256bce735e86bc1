"""A create's session options and image, checked by the pipeline itself before the server holds anything.

The API process does not import the pipeline when its workers run out of process (process workers,
worker agents), so it asks a ready worker: the service's ``check_options`` and, for a create that gives an
image, its ``check_image`` of the image's size (the very checks its ``create_session`` or ``stream`` runs),
in one round trip to the worker's process, through the process proxy or the agent's connection. A refusal
is an HTTP 400 with the pipeline's own words, ``invalid_option`` or ``invalid_image`` naming the image's
field; no slot, queue place, room or token is taken. Every worker runs the same pipeline, so one's word
holds for all: the ready workers take turns, and one that does not answer (a hung check, an agent
that stopped answering but still heartbeats) gives its turn to the next within the create's
deadline, and is asked after the others until it answers again. The first ready worker used to be
asked every time, so one mute agent made every create in the cluster a 503.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from states.worker import ELIGIBLE

from .log_pace import LogPace
from .reasons import public_reason, without_prefix
from .requests import ImageSize, OptionsRefused, SessionImageRefused
from .runtime_errors import NO_WORKER_RETRY_AFTER, NoWorker

if TYPE_CHECKING:
    from .runtime import StreamRuntime

__all__ = ["CHECK_OPTIONS_TIMEOUT", "MAX_CHECKS_AT_ONCE", "NOT_CHECKED", "WORKER_CHECK_TIMEOUT", "OptionCheckers", "check_options"]

log = logging.getLogger("chunkline.runtime")

#: seconds a create waits for a worker's check of its options (a process child's own deadline is longer)
CHECK_OPTIONS_TIMEOUT = 10.0
#: seconds one worker has to answer before the next ready one is asked (within CHECK_OPTIONS_TIMEOUT)
WORKER_CHECK_TIMEOUT = CHECK_OPTIONS_TIMEOUT / 2
#: seconds past which a worker's answer, though taken, puts it after the others for the next checks
SLOW_ANSWER = 1.0
#: what a 503 says before the last worker's reason (which is not to say it again)
NOT_CHECKED = "the session's options could not be checked:"
#: checks under way at once; more wait their turn within their deadline (an agent's outbox holds 256 messages)
MAX_CHECKS_AT_ONCE = 16


class OptionCheckers:
    """Which ready worker checks the next create's options: each in turn, one whose last check failed or was slow
    last."""

    def __init__(self) -> None:
        self.limiter = trio.CapacityLimiter(MAX_CHECKS_AT_ONCE)
        self._turn = 0
        self._failed: set[str] = set()  # workers whose last check failed or was slow; ids of ready workers only
        self.failures = LogPace(log)  # one line for each create a mute worker failed flooded the log

    def order(self, ready: list[Any]) -> list[Any]:
        """``ready`` starting at the next worker's turn, those whose last check failed moved to the end."""
        self._turn += 1
        self._failed &= {worker.worker_id for worker in ready}
        start = self._turn % len(ready)
        return sorted(ready[start:] + ready[:start], key=lambda worker: worker.worker_id in self._failed)

    def answered(self, worker_id: str, seconds: float) -> None:
        """The worker answered a check in ``seconds``: one that took past :data:`SLOW_ANSWER` is asked last too (one
        answering just inside its 5 s held every create it was asked first for those 5 s)."""
        if seconds > SLOW_ANSWER:
            self._failed.add(worker_id)
        else:
            self._failed.discard(worker_id)

    def failed(self, worker_id: str) -> None:
        self._failed.add(worker_id)


async def check_options(runtime: StreamRuntime, options: dict[str, Any], image: ImageSize | None = None) -> None:
    """Raise :class:`OptionsRefused` (400) when the pipeline refuses ``options``, :class:`SessionImageRefused` (400
    naming its field) when it refuses ``image``.

    No options are checked too (a pipeline may require one: its refusal names it). With no worker
    ready yet (every one loading), or one that does not answer within :data:`CHECK_OPTIONS_TIMEOUT`,
    the options cannot be checked: ``NoWorker`` (503 with Retry-After) — except no options and no image,
    which are taken unchecked then, as before (the session waits for a worker, whose pipeline checks them
    when it starts the session). With no worker at all, or while the server stops,
    ``create_session`` answers as it always does.
    """
    nothing_to_check = not options and image is None
    image_size = None if image is None else (image.width, image.height)
    if runtime.closing or not runtime.book.can_place():
        return
    ready = ready_workers(runtime)
    if not ready:
        if nothing_to_check:
            return
        raise NoWorker("no worker is ready to check the session's options yet (every worker is starting)",
                       NO_WORKER_RETRY_AFTER)
    checkers = runtime.option_checks
    give_up = trio.current_time() + CHECK_OPTIONS_TIMEOUT
    reason = "no answer in time"
    for worker in checkers.order(ready):
        asked_at: float | None = None
        try:
            with trio.fail_at(give_up):
                async with checkers.limiter:  # a turn here is not the worker's time to answer
                    asked_at = trio.current_time()
                    with trio.fail_at(min(give_up, asked_at + WORKER_CHECK_TIMEOUT)):
                        await worker.check_options(options, image_size)
        except (OptionsRefused, SessionImageRefused) as exc:
            checkers.answered(worker.worker_id, trio.current_time() - asked_at)  # type: ignore[operator]
            if isinstance(exc, SessionImageRefused) and image is not None:  # the worker knows no field: named here
                raise SessionImageRefused(exc.reason, field=image.field, worker_id=exc.worker_id) from None
            raise
        except Exception as exc:  # a timeout, a worker lost meanwhile, a check that is itself broken
            if asked_at is not None:  # not one whose deadline passed while others' checks held every turn
                checkers.failed(worker.worker_id)
            checkers.failures.warning("worker %s could not check a session's options: %r", worker.worker_id, exc)
            # the failure's own words, never its type (a public 503 said "RuntimeError: worker lost: ...")
            reason = "no answer in time" if isinstance(exc, trio.TooSlowError) else public_reason(exc, prefix_type=False)
            if trio.current_time() >= give_up:
                break
        else:
            checkers.answered(worker.worker_id, trio.current_time() - asked_at)  # type: ignore[operator]
            return
    if nothing_to_check:  # taken unchecked, as with no worker ready (it was a 503 here: a mute worker refused every create)
        return
    raise NoWorker(f"{NOT_CHECKED} {without_prefix(reason, NOT_CHECKED)}", NO_WORKER_RETRY_AFTER) from None


def ready_workers(runtime: StreamRuntime) -> list[Any]:
    """The workers that have loaded the pipeline and take sessions (not one failing)."""
    return [worker for worker_id, worker in runtime.workers.items()
            if runtime.book.worker_state(worker_id) in ELIGIBLE and not worker.out_of_service]
