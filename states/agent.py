"""Lifecycle of one worker agent (``chunkline worker``) as the agent itself sees it.

Theory of operation
-------------------
An agent is STARTING while it loads its pipeline, runs its startup check, dials and
shakes hands, and again after a registration was cut off (it dials anew). SERVE
(its Ready went out on a live registration) makes it SERVING, the only state that
takes sessions. CUT_OFF (the registration ended without a goodbye: its sessions are
stopped) makes it REDIALING, dialing again; SERVE there serves again. A stop signal (SIGTERM, SIGINT) or the authority's DRAIN while
SERVING makes it DRAINING: no new sessions, live ones finish by the deadline, then
a goodbye and exit 0. A second stop signal while DRAINING cuts the drain short
(CUT_SHORT: sessions stop now, exit 128 + signal). A stop signal while STARTING
makes it STOPPING: it never says Ready (a create landing then would have been
placed on an agent already leaving), leaves at once and exits 128 + signal. One
while REDIALING makes it RETIRING: it does not register again either, and exits 0
(it served, and has nothing left to drain). END
(the agent's run is over, whatever the reason) makes it ENDED, the only terminal
state. Signals and drains that change nothing loop on the state they arrive in.
"""

from __future__ import annotations

from .machine import StateMachine, TableEnum

__all__ = ["State", "Event", "TRANSITIONS", "TERMINAL", "TAKES_SESSIONS", "DIALS", "LEAVING", "SIGNALLED_EXIT",
           "AgentMachine"]


class State(TableEnum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    CUT_SHORT = "cut_short"
    STOPPING = "stopping"
    REDIALING = "redialing"
    RETIRING = "retiring"
    ENDED = "ended"


class Event(TableEnum):
    SERVE = "serve"
    CUT_OFF = "cut_off"
    STOP_SIGNAL = "stop_signal"
    DRAIN = "drain"
    END = "end"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.STARTING, Event.SERVE): State.SERVING,
    (State.STARTING, Event.STOP_SIGNAL): State.STOPPING,
    (State.STARTING, Event.END): State.ENDED,
    (State.SERVING, Event.CUT_OFF): State.REDIALING,
    (State.SERVING, Event.STOP_SIGNAL): State.DRAINING,
    (State.SERVING, Event.DRAIN): State.DRAINING,
    (State.SERVING, Event.END): State.ENDED,
    (State.DRAINING, Event.STOP_SIGNAL): State.CUT_SHORT,
    (State.DRAINING, Event.DRAIN): State.DRAINING,
    (State.DRAINING, Event.END): State.ENDED,
    (State.CUT_SHORT, Event.STOP_SIGNAL): State.CUT_SHORT,
    (State.CUT_SHORT, Event.DRAIN): State.CUT_SHORT,
    (State.CUT_SHORT, Event.END): State.ENDED,
    (State.STOPPING, Event.STOP_SIGNAL): State.STOPPING,
    (State.STOPPING, Event.DRAIN): State.STOPPING,
    (State.STOPPING, Event.END): State.ENDED,
    (State.REDIALING, Event.SERVE): State.SERVING,
    (State.REDIALING, Event.STOP_SIGNAL): State.RETIRING,
    (State.REDIALING, Event.END): State.ENDED,
    (State.RETIRING, Event.STOP_SIGNAL): State.RETIRING,
    (State.RETIRING, Event.DRAIN): State.RETIRING,
    (State.RETIRING, Event.END): State.ENDED,
}

TERMINAL = frozenset({State.ENDED})

#: The only state in which a Start is taken (in any other the agent refuses it: it is leaving, or not yet serving).
TAKES_SESSIONS = frozenset({State.SERVING})
#: States in which a registration that ended leads to another dial (derived from the table: SERVE leaves them).
DIALS = frozenset(source for (source, event) in TRANSITIONS if event is Event.SERVE)
#: States in which the agent is on its way out: a registration that ends ends the agent.
LEAVING = frozenset({State.DRAINING, State.CUT_SHORT, State.STOPPING, State.RETIRING})
#: States whose exit is 128 + the stop signal that led there (a drain that ran its course exits 0).
SIGNALLED_EXIT = frozenset({State.CUT_SHORT, State.STOPPING})


class AgentMachine(StateMachine[State, Event]):
    NAME = "agent"
    TABLE = TRANSITIONS
    INITIAL = State.STARTING
    TERMINAL = TERMINAL
