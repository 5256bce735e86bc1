"""Lifecycle of one worker agent (``chunkline worker``) as the agent itself sees it.

Theory of operation
-------------------
An agent is LOADING while it loads its pipeline and runs its startup check; LOADED (its
service is up) makes it STARTING while it dials and shakes hands, and it is STARTING again
after a registration was cut off (it dials anew). SERVE (its Ready went out on a live
registration) makes it SERVING, the only state that takes sessions. CUT_OFF (the
registration ended without a goodbye: its sessions are stopped) makes it REDIALING,
dialing again; SERVE there serves again. A stop signal (SIGTERM, SIGINT, or SIGHUP
unless it was ignored as the agent started, as under ``nohup``) or the authority's
DRAIN while SERVING makes it DRAINING: no new sessions, live ones finish by the
deadline; GOODBYE (its goodbye went out once the drain ran its course) makes it
DRAINED. A second stop signal while DRAINING cuts the drain short (CUT_SHORT: sessions
stop now, then a goodbye). A stop signal while STARTING makes it STOPPING: it never says
Ready (a create landing then would have been placed on an agent already leaving) and
leaves at once. One while REDIALING makes it RETIRING: it does not register again either.
A stop signal while LOADING, or while the agent is already on its way out (STOPPING,
CUT_SHORT, RETIRING, DRAINED), ABORTS it: the process ends now, without waiting for what
is under way (a pipeline still loading, a dial, a close), taking its child processes and
their shared memory with it. While LOADING that is the first signal's due: no session can
be on a service that is not up and no authority has heard of the agent, so there is
nothing to drain or tell, and a load cannot be cancelled (it may take minutes, or hang).
WORKER_FAILED (its model worker failed once loaded: its service process died, a runner
gave up on a close that hung) while STARTING, SERVING, REDIALING or DRAINING makes it
FAILED: nothing is left to run sessions on, so it tells the authority and leaves (it
stayed registered with its full capacity, and the next Start placed on it ended the agent
with a traceback); a stop signal then ends it at once.
END (the agent's run is over, whatever the reason) makes it ENDED, the only terminal
state. Signals, drains, goodbyes and worker failures that change nothing loop on the
state they arrive in.

How it exits is :func:`exit_status`, one rule for every phase: 1 once its worker failed
(FAILED); 0 once a drain ran its course (DRAINED), and after a drain the authority asked
for without any signal; 128 + the first stop signal when a signal led it out before a
drain ran its course (STOPPING, CUT_SHORT, RETIRING, ABORTED, or DRAINING cut off from
the authority). A supervisor reads 0 as "it finished as asked", never as "a signal ended
it".
"""

from __future__ import annotations

import enum

from .machine import StateMachine, TableEnum

__all__ = ["State", "Event", "TRANSITIONS", "TERMINAL", "TAKES_SESSIONS", "DIALS", "LEAVING", "WORKER_GONE",
           "ON_STOP_SIGNAL", "StopSignalAct", "AgentMachine", "exit_status", "start_refusal"]


class State(TableEnum):
    LOADING = "loading"
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    DRAINED = "drained"
    CUT_SHORT = "cut_short"
    STOPPING = "stopping"
    REDIALING = "redialing"
    RETIRING = "retiring"
    ABORTED = "aborted"
    FAILED = "failed"
    ENDED = "ended"


class Event(TableEnum):
    LOADED = "loaded"
    SERVE = "serve"
    CUT_OFF = "cut_off"
    STOP_SIGNAL = "stop_signal"
    DRAIN = "drain"
    GOODBYE = "goodbye"
    WORKER_FAILED = "worker_failed"
    END = "end"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.LOADING, Event.LOADED): State.STARTING,
    (State.LOADING, Event.STOP_SIGNAL): State.ABORTED,
    (State.LOADING, Event.END): State.ENDED,
    (State.STARTING, Event.SERVE): State.SERVING,
    (State.STARTING, Event.STOP_SIGNAL): State.STOPPING,
    (State.STARTING, Event.END): State.ENDED,
    (State.SERVING, Event.CUT_OFF): State.REDIALING,
    (State.SERVING, Event.STOP_SIGNAL): State.DRAINING,
    (State.SERVING, Event.DRAIN): State.DRAINING,
    (State.SERVING, Event.END): State.ENDED,
    (State.DRAINING, Event.STOP_SIGNAL): State.CUT_SHORT,
    (State.DRAINING, Event.DRAIN): State.DRAINING,
    (State.DRAINING, Event.GOODBYE): State.DRAINED,
    (State.DRAINING, Event.END): State.ENDED,
    (State.DRAINED, Event.STOP_SIGNAL): State.ABORTED,
    (State.DRAINED, Event.DRAIN): State.DRAINED,
    (State.DRAINED, Event.GOODBYE): State.DRAINED,
    (State.DRAINED, Event.END): State.ENDED,
    (State.CUT_SHORT, Event.STOP_SIGNAL): State.ABORTED,
    (State.CUT_SHORT, Event.DRAIN): State.CUT_SHORT,
    (State.CUT_SHORT, Event.GOODBYE): State.CUT_SHORT,
    (State.CUT_SHORT, Event.END): State.ENDED,
    (State.STOPPING, Event.STOP_SIGNAL): State.ABORTED,
    (State.STOPPING, Event.DRAIN): State.STOPPING,
    (State.STOPPING, Event.GOODBYE): State.STOPPING,
    (State.STOPPING, Event.END): State.ENDED,
    (State.REDIALING, Event.SERVE): State.SERVING,
    (State.REDIALING, Event.STOP_SIGNAL): State.RETIRING,
    (State.REDIALING, Event.END): State.ENDED,
    (State.RETIRING, Event.STOP_SIGNAL): State.ABORTED,
    (State.RETIRING, Event.DRAIN): State.RETIRING,
    (State.RETIRING, Event.GOODBYE): State.RETIRING,
    (State.RETIRING, Event.END): State.ENDED,
    (State.ABORTED, Event.STOP_SIGNAL): State.ABORTED,
    (State.ABORTED, Event.DRAIN): State.ABORTED,
    (State.ABORTED, Event.GOODBYE): State.ABORTED,
    (State.ABORTED, Event.END): State.ENDED,
    (State.STARTING, Event.WORKER_FAILED): State.FAILED,
    (State.SERVING, Event.WORKER_FAILED): State.FAILED,
    (State.REDIALING, Event.WORKER_FAILED): State.FAILED,
    (State.DRAINING, Event.WORKER_FAILED): State.FAILED,
    (State.DRAINED, Event.WORKER_FAILED): State.DRAINED,
    (State.CUT_SHORT, Event.WORKER_FAILED): State.CUT_SHORT,
    (State.STOPPING, Event.WORKER_FAILED): State.STOPPING,
    (State.RETIRING, Event.WORKER_FAILED): State.RETIRING,
    (State.ABORTED, Event.WORKER_FAILED): State.ABORTED,
    (State.FAILED, Event.WORKER_FAILED): State.FAILED,
    (State.FAILED, Event.STOP_SIGNAL): State.ABORTED,
    (State.FAILED, Event.DRAIN): State.FAILED,
    (State.FAILED, Event.GOODBYE): State.FAILED,
    (State.FAILED, Event.END): State.ENDED,
}

TERMINAL = frozenset({State.ENDED})

#: The only state in which a Start is taken (in any other the agent refuses it: it is leaving, or not yet serving).
TAKES_SESSIONS = frozenset({State.SERVING})
#: Why a Start is refused in a state that does not take it, where that is not its drain (``start_refusal``).
_REFUSED_AS = {State.FAILED: "the worker failed"}


def start_refusal(state: State) -> str | None:
    """Why an agent in ``state`` refuses a Start (None: it takes it)."""
    return None if state in TAKES_SESSIONS else _REFUSED_AS.get(state, "the worker is draining")


#: States in which a registration that ended leads to another dial (derived from the table: SERVE leaves them).
DIALS = frozenset(source for (source, event) in TRANSITIONS if event is Event.SERVE)
#: States in which the agent is on its way out: a registration that ends ends the agent.
LEAVING = frozenset({State.DRAINING, State.DRAINED, State.CUT_SHORT, State.STOPPING, State.RETIRING, State.ABORTED,
                     State.FAILED})
#: The state in which the agent leaves because its model worker failed: it tells the authority, then exits 1.
WORKER_GONE = frozenset({State.FAILED})


class StopSignalAct(enum.Enum):
    """What the agent does once a stop signal moved it (``ON_STOP_SIGNAL``)."""

    ABORT = "abort"  # end the process now, without waiting for what is under way
    DRAIN = "drain"  # take no new session; the live ones finish by the drain deadline
    CUT_SHORT = "cut_short"  # stop the sessions now, then say goodbye
    LEAVE_UNSERVED = "leave_unserved"  # it never served: leave without saying ready
    LEAVE_CUT_OFF = "leave_cut_off"  # cut off from the authority: leave without registering again


#: What a stop signal makes the agent do, by the state the signal moved it to (every state a STOP_SIGNAL row leads to).
ON_STOP_SIGNAL: dict[State, StopSignalAct] = {
    State.ABORTED: StopSignalAct.ABORT,
    State.DRAINING: StopSignalAct.DRAIN,
    State.CUT_SHORT: StopSignalAct.CUT_SHORT,
    State.STOPPING: StopSignalAct.LEAVE_UNSERVED,
    State.RETIRING: StopSignalAct.LEAVE_CUT_OFF,
}
#: States in which the agent finished what it was asked to do: its exit is 0 whatever signal began it.
_FINISHED = frozenset({State.DRAINED})


def exit_status(state: State, first_signal: int | None) -> int:
    """The exit status of an agent leaving in ``state``; ``first_signal`` is the first stop signal it got (None: none).

    1 once its worker failed (a supervisor or launcher starts another); 0 once its drain ran its course, or when no
    signal led it out (a drain the authority asked for); else 128 + the first stop signal, as ``chunkline
    stream-serve`` and ``chunkline run`` exit when a signal stopped them."""
    if state in WORKER_GONE:
        return 1
    if state in _FINISHED or first_signal is None:
        return 0
    return 128 + first_signal


class AgentMachine(StateMachine[State, Event]):
    NAME = "agent"
    TABLE = TRANSITIONS
    INITIAL = State.LOADING
    TERMINAL = TERMINAL
