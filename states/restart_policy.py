"""Restart policy of a failed worker: exponential backoff, then a crash-loop limit.

Theory of operation
-------------------
A worker *slot* (``worker-0``, whatever incarnation fills it) is RUNNING while
its current worker runs or starts. When that worker fails, the policy counts the
failures inside a sliding ``window``: up to ``max_failures`` of them, the slot
goes BACKING_OFF and a replacement is due ``delay`` seconds later, the delay
doubling (``factor``) from ``base_delay`` up to ``max_delay`` with each failure
still inside the window (failures older than the window are forgotten, so a
worker that ran well for a while starts again from ``base_delay``). One failure
more than ``max_failures`` inside the window is a crash loop: GAVE_UP, terminal,
the slot stays failed and :meth:`RestartTracker.describe` says why. A failure
that says the worker refused its configuration (``permanent``) gives up at once:
every replacement would refuse it the same way. So does a load that fails the way
the slot's last load failed while no worker of the slot has ever loaded
(LOAD_REPEATED): a pipeline that raises as it is imported or built fails every
load alike, and five retries with a traceback each told nothing the first did not;
a worker that loaded once and then failed is a crash, retried with backoff as
above. RESTARTED
(the replacement was started) returns to RUNNING; STOP (the server stops)
ends any live state in STOPPED.

A launched agent can be lost while its process lives on (frozen, cut off): its launcher gives it a window to
register again and ends it after that. WORKER_LOST takes the slot to LOST for that window (health said
``running`` with no worker): it returns to RUNNING when the agent registers again (REREGISTERED), and its process's
end is a failure as from RUNNING.

:class:`RestartTracker` is pure: every method that depends on time takes ``now``
(seconds, any monotonic clock), it holds no clock, lock or I/O, and it decides
which event its machine gets; nothing else moves the machine.

    tracker = RestartTracker(RestartPolicy(base_delay=1, max_delay=30, max_failures=5, window=300))
    decision = tracker.failure(now, "exit code -9 (SIGKILL)")   # Decision(event=FAILED, delay=1.0, ...)
    if tracker.due(later): start_replacement(); tracker.restarted(later)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable

import attrs

from .machine import StateMachine, TableEnum

__all__ = ["State", "Event", "TRANSITIONS", "TERMINAL", "RestartMachine", "RestartPolicy", "Decision", "RestartTracker"]


class State(TableEnum):
    RUNNING = "running"
    LOST = "lost"  # its agent was lost and its process lives on: it registers again, or is ended
    BACKING_OFF = "backing_off"
    GAVE_UP = "gave_up"
    STOPPED = "stopped"


class Event(TableEnum):
    FAILED = "failed"  # the worker failed; a replacement is allowed after the backoff
    CRASH_LOOP = "crash_loop"  # the worker failed once too often inside the window
    REFUSED = "refused"  # the worker refused its configuration: a replacement would refuse it the same way
    LOAD_REPEATED = "load_repeated"  # a load failed as the last one did, and no worker of the slot ever loaded
    RESTARTED = "restarted"  # the replacement was started
    STOP = "stop"  # the server stops: no more restarts
    WORKER_LOST = "worker_lost"  # its agent was lost while its process lives on (a window to register again)
    REREGISTERED = "reregistered"  # that agent registered again within the window


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.RUNNING, Event.FAILED): State.BACKING_OFF,
    (State.RUNNING, Event.CRASH_LOOP): State.GAVE_UP,
    (State.RUNNING, Event.REFUSED): State.GAVE_UP,
    (State.RUNNING, Event.LOAD_REPEATED): State.GAVE_UP,
    (State.RUNNING, Event.STOP): State.STOPPED,
    (State.BACKING_OFF, Event.RESTARTED): State.RUNNING,
    (State.BACKING_OFF, Event.STOP): State.STOPPED,
    (State.RUNNING, Event.WORKER_LOST): State.LOST,
    (State.LOST, Event.REREGISTERED): State.RUNNING,
    (State.LOST, Event.FAILED): State.BACKING_OFF,
    (State.LOST, Event.CRASH_LOOP): State.GAVE_UP,
    (State.LOST, Event.REFUSED): State.GAVE_UP,
    (State.LOST, Event.LOAD_REPEATED): State.GAVE_UP,
    (State.LOST, Event.STOP): State.STOPPED,
}

TERMINAL = frozenset({State.GAVE_UP, State.STOPPED})


class RestartMachine(StateMachine[State, Event]):
    NAME = "restart"
    TABLE = TRANSITIONS
    INITIAL = State.RUNNING
    TERMINAL = TERMINAL


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


def _count(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be an integer >= 0, got {value!r}")


@attrs.frozen
class RestartPolicy:
    """How soon and how often a failed worker is replaced. A bad value raises ``ValueError`` naming it."""

    base_delay: float = attrs.field(default=1.0, validator=_positive)
    max_delay: float = attrs.field(default=60.0, validator=_positive)
    factor: float = attrs.field(default=2.0, validator=_positive)
    max_failures: int = attrs.field(default=5, validator=_count)
    window: float = attrs.field(default=600.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.max_delay < self.base_delay:
            raise ValueError(f"max_delay ({self.max_delay!r}) must be >= base_delay ({self.base_delay!r})")
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1, got {self.factor!r}")

    def delay(self, failures: int) -> float:
        """Seconds before the replacement after the ``failures``-th failure inside the window (>= 1)."""
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures!r}")
        exponent = failures - 1
        if self.factor > 1 and exponent >= math.log(self.max_delay / self.base_delay, self.factor):
            return self.max_delay  # the cap applies (and factor**exponent could overflow)
        return min(self.max_delay, self.base_delay * self.factor**exponent)


@attrs.frozen
class Decision:
    """What one failure led to: a restart after ``delay`` (at ``due_at``), or giving up."""

    event: Event
    failures: int  # failures inside the window, this one included
    delay: float | None
    due_at: float | None
    reason: str


class RestartTracker:
    """One worker slot: its failures inside the window, its restart machine, its restart count."""

    __slots__ = ("policy", "machine", "restarts", "due_at", "last_cause", "refusal", "ever_loaded", "last_load_failure",
                 "lost", "_failures")

    def __init__(self, policy: RestartPolicy | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self.machine = RestartMachine()
        self.restarts = 0
        self.due_at: float | None = None
        self.last_cause: str | None = None
        self.refusal: str | None = None  # why it gave up at once: refused its configuration, or a load failed again
        self.ever_loaded = False  # a worker of this slot has loaded its pipeline (then a failure is a crash)
        self.last_load_failure: Hashable | None = None  # how the slot's last failed load failed (its kind and words)
        self.lost: tuple[str, float] | None = None  # while LOST: why, and when its process is ended
        self._failures: deque[float] = deque()

    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def ended(self) -> bool:
        """The slot gave up or was stopped: it starts no worker again."""
        return self.machine.is_terminal

    def failures(self, now: float) -> int:
        """Failures inside the window ending at ``now``."""
        self._forget(now)
        return len(self._failures)

    def _forget(self, now: float) -> None:
        while self._failures and now - self._failures[0] >= self.policy.window:
            self._failures.popleft()

    def loaded(self) -> None:
        """A worker of this slot loaded its pipeline: from now on a failure is a crash, never a load that repeats."""
        self.ever_loaded = True

    def failure(self, now: float, cause: str, *, permanent: bool = False, load_failure: Hashable | None = None
                ) -> Decision:
        """The running worker failed with ``cause``: back off, or give up on a crash loop, when ``permanent`` (the
        worker refused its configuration: a replacement would too), or when ``load_failure`` (how its load failed;
        None for a worker that had loaded, or a failure that says nothing of the next load, such as a timeout)
        equals the slot's last one and no worker of the slot has ever loaded."""
        event = Event.FAILED
        self._forget(now)
        failures = len(self._failures) + 1
        repeated = load_failure is not None and not self.ever_loaded and load_failure == self.last_load_failure
        if permanent:
            event = Event.REFUSED
        elif repeated:
            event = Event.LOAD_REPEATED
        elif failures > self.policy.max_failures:
            event = Event.CRASH_LOOP
        self.machine.apply(event)  # raises IllegalTransition (changing nothing) unless RUNNING or LOST
        self.lost = None
        self._failures.append(now)
        self.last_cause = cause
        self.last_load_failure = load_failure
        window = f"{self.policy.window:g} s"
        if event is Event.REFUSED:
            self.due_at = None
            self.refusal = f"refused its configuration; not restarted ({cause})"
            return Decision(event, failures, None, None, self.refusal)
        if event is Event.LOAD_REPEATED:
            self.due_at = None
            self.refusal = f"the pipeline never loaded: it failed the same way twice in a row ({cause}); not restarted"
            return Decision(event, failures, None, None, self.refusal)
        if event is Event.CRASH_LOOP:
            self.due_at = None
            reason = f"crash loop: {failures} failures within {window}; not restarted (last: {cause})"
            return Decision(event, failures, None, None, reason)
        delay = self.policy.delay(failures)
        self.due_at = now + delay
        reason = f"failed ({cause}); restart {failures} of {self.policy.max_failures} within {window} in {delay:g} s"
        if load_failure is not None and not self.ever_loaded:  # LOAD_REPEATED comes before the crash-loop limit
            reason += "; a repeat of the same load failure ends it"
        return Decision(event, failures, delay, self.due_at, reason)

    def worker_lost(self, cause: str, ended_at: float) -> None:
        """Its agent was lost with ``cause`` while its process lives on, and is ended at ``ended_at`` unless it
        registers again: LOST (a no-op unless RUNNING)."""
        if self.machine.can(Event.WORKER_LOST):
            self.machine.apply(Event.WORKER_LOST)
            self.lost = (cause, ended_at)

    def reregistered(self) -> None:
        """The lost agent registered again: RUNNING (a no-op unless LOST)."""
        if self.machine.can(Event.REREGISTERED):
            self.machine.apply(Event.REREGISTERED)
            self.lost = None

    def due(self, now: float) -> bool:
        """Whether the replacement should start now."""
        return self.machine.state is State.BACKING_OFF and self.due_at is not None and now >= self.due_at

    def retry_after(self, now: float) -> float | None:
        """Seconds until the replacement is due (0 when overdue), or None when none is coming."""
        if self.machine.state is not State.BACKING_OFF or self.due_at is None:
            return None
        return max(0.0, self.due_at - now)

    def restarted(self, now: float) -> None:
        """The replacement was started (only when :meth:`due`)."""
        if not self.due(now):
            raise ValueError(f"no restart is due at {now!r} (state {self.machine.state.value}, due at {self.due_at!r})")
        self.machine.apply(Event.RESTARTED)
        self.restarts += 1
        self.due_at = None

    def stop(self) -> None:
        """The server stops: no more restarts (a no-op once terminal)."""
        if self.machine.can(Event.STOP):
            self.machine.apply(Event.STOP)
            self.due_at = None

    def describe(self, now: float) -> str | None:
        """Why the slot is not running, for health: its lost agent's end, the backoff left, the refusal or the crash
        loop; None when running."""
        state = self.machine.state
        if state is State.LOST and self.lost is not None:
            cause, ended_at = self.lost
            return (f"its agent was lost ({cause}) and its process lives on: ended in {max(0.0, ended_at - now):.1f} s "
                    f"unless it registers again")
        if state is State.BACKING_OFF:
            left = self.retry_after(now) or 0.0
            return f"restarting in {left:.1f} s after: {self.last_cause}"
        if state is State.GAVE_UP and self.refusal is not None:
            return self.refusal
        if state is State.GAVE_UP:
            return (
                f"crash loop: more than {self.policy.max_failures} failures within {self.policy.window:g} s; "
                f"not restarted (last: {self.last_cause})"
            )
        if state is State.STOPPED:
            return "stopped on purpose (drained, or the server is stopping); not restarted"
        return None
