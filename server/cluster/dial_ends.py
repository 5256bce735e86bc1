"""How one of an agent's dials ended, and how long it waits before the next (:mod:`server.cluster.agent`).

The authority's answer to a Register is judged here by what it proves, never by its text: a Welcome or
Refused or Busy whose proof (:mod:`server.cluster.proofs`) does not match is from someone who does not
hold the cluster token, and is obeyed as nothing more than a failed connect (counted toward the
agent's crash-loop limit). A proven refusal says on the wire whether it is ``transient`` (the same
agent may be taken later: the authority does not know its rooms URL yet, the worker id was taken): then
the agent waits and dials again without counting it, for :data:`TRANSIENT_DEADLINE` at most; a proven
permanent refusal (another version or pipeline) ends the agent with exit code 3; so does a crash loop of
unproven ones, frames of another wire protocol version among them. A proven Busy (the
authority has as many handshakes pending as it allows: someone may be flooding it) is waited out,
however long it lasts: only a holder of the token can say it. Such waits are logged at a pace
(:class:`DialLog`): an authority down for its 300 s made an agent log a line for each dial, one a second.

A registration ends uncounted too when the authority goes with no word (:func:`vanished`): its connection closes
or is reset, as when the authority is killed (SIGKILL, out of memory) or crashes and its supervisor restarts it.
The agent did nothing wrong, and counted, 9 authority restarts in a minute ended every external agent for good;
it dials again at the waits' pace, as it dials an unreachable one. What the agent caused is still counted: the
authority names it before it closes (a proven refusal: a protocol error of the agent's, a deadline the agent
missed), and so are a frame that breaks the protocol, an authority that stops reading and the agent's own worker
failing. A fence is not (:data:`End.FENCED`): no heartbeat acknowledged in time, or the authority's tagged word that it
lost the agent on the heartbeat clock (a transient loss notice), is the authority's silence or verdict, not the agent
crashing; counted, an authority that stalled now and then pushed its external agents toward giving up for good.
"""

from __future__ import annotations

import enum
import logging
import random

import attrs

from states.restart_policy import RestartPolicy

from ..log_pace import LogPace
from ..reasons import cut, echo
from . import proofs, wire

__all__ = ["DIAL_DEADLINES", "End", "Ended", "answer", "Patience", "DialLog", "TRANSIENT_DEADLINE",
           "UNREACHABLE_DEADLINE", "NOT_AN_AUTHORITY_DEADLINE", "WAIT_POLICY", "MAX_PROVEN_REASON", "DIAL_LOG_EVERY",
           "WAITED", "UNCOUNTED", "vanished"]

log = logging.getLogger("chunkline.agent")

#: characters of a proven refusal's or busy's reason an agent keeps and logs: the authority's own reasons stay well
#: within it (each piece of a peer's text in them is echoed, cut); a frame before the proofs may hold 64 KiB of it
MAX_PROVEN_REASON = 1024

#: seconds of unbroken transient refusals (no registration between) after which the agent gives up (exit 1)
TRANSIENT_DEADLINE = 120.0
#: seconds of an unbroken run of dials that reach no authority at all (it restarts: its drain alone may take 55 s)
#: after which an agent gives up (exit 1); before, such dials counted toward the crash-loop limit, and an external
#: agent, which no launcher replaces, was gone for good some 20 s into an authority's restart
UNREACHABLE_DEADLINE = 300.0
#: seconds of an unbroken run of dials answered by something that is not an authority (no hello within the connect
#: deadline, or bytes that are not a frame: the HTTP port given for the cluster port) after which an agent gives up
#: (exit 3); counted toward the crash-loop limit, they never filled its window, each taking the 10 s deadline (they are
#: not counted now: this deadline bounds them)
NOT_AN_AUTHORITY_DEADLINE = 60.0
#: seconds between an agent's lines while one kind of dial keeps waiting (unreachable, busy, refused for now, not an
#: authority): the first is logged at once, then one with the count at most this often
DIAL_LOG_EVERY = 30.0
#: the waits between dials the authority asked for (busy, a transient refusal): short, bounded, never counted
WAIT_POLICY = RestartPolicy(base_delay=0.2, max_delay=2.0, max_failures=8, window=60.0)


class End(enum.Enum):
    """How one registration (or one attempt at it) ended: what the agent does next."""

    LOST = "lost"  # back off and register again (counted toward the crash-loop limit)
    UNREACHABLE = "unreachable"  # no connection to the authority at all: dial again, not counted, up to a deadline
    NOT_AN_AUTHORITY = "not_an_authority"  # the address answered, not with a hello: as unreachable, a shorter deadline
    BUSY = "busy"  # a proven busy: wait and dial again, not counted, however long it lasts
    TRANSIENT = "transient"  # a proven transient refusal: wait and dial again, not counted, up to a deadline
    REFUSED = "refused"  # a proven permanent refusal: exit 3
    UNPROVEN_REFUSAL = "unproven_refusal"  # a refusal nobody proved, another protocol: as lost; a crash loop exits 3
    #: the authority said goodbye as it stopped (its own drain done; a tagged frame, so only it can say so): dial again,
    #: not counted (counted, 9 authority restarts in a minute ended every external agent with exit 3)
    AUTHORITY_STOPPED = "authority_stopped"
    #: the connection to an authority that had taken this agent closed or was reset with no word (killed, crashed):
    #: dial again at the waits' pace, not counted
    AUTHORITY_GONE = "authority_gone"
    #: the registration ended in a fence: no heartbeat acknowledged in time (the agent fenced itself), or the authority
    #: lost the agent on the heartbeat clock and said so (a transient loss notice): dial again at the waits' pace, not
    #: counted (each fence follows a registration, so they never loop)
    FENCED = "fenced"
    DRAINED = "drained"  # exit 0
    STOPPED = "stopped"  # a stop signal before the register went out: exit 128 + the signal (states.agent)


@attrs.frozen
class Ended:
    kind: End
    why: str


def vanished(exc: wire.ConnectionClosed) -> bool:
    """Whether a registered agent's connection ended with the authority gone, no fault of the agent's: it closed or was
    reset. An authority that stopped taking frames (:class:`~server.cluster.wire.PeerStalled`) has not gone, and a TLS
    failure on a live connection is no close (:class:`~server.cluster.wire.TlsFailed`)."""
    return not isinstance(exc, (wire.PeerStalled, wire.TlsFailed))


def answer(reply: wire.Message, *, token: str, at: str, nonce: str, agent_nonce: str, worker_id: str,
           unproven: LogPace | None = None) -> Ended | None:
    """Why the authority's answer to a Register ends this attempt; None for a Welcome that proves the token.
    ``unproven`` paces the line a refusal nobody proved logs (another token is refused on every dial)."""
    if isinstance(reply, wire.Refused):
        if proofs.refusal_proof_matches(token, nonce, agent_nonce, worker_id, reply.reason, reply.transient,
                                        reply.proof):
            reason = cut(reply.reason, MAX_PROVEN_REASON)  # logged here, or by the agent as it waits
            if reply.transient:
                return Ended(End.TRANSIENT, reason)
            log.error("the authority refused this worker: %s", reason)
            return Ended(End.REFUSED, reason)
        (unproven or LogPace(log)).warning("%s refused this worker without proving the cluster token (the token "
                                           "differs there, or it is not the authority): %s", at, echo(reply.reason))
        return Ended(End.UNPROVEN_REFUSAL, f"refused without proof: {echo(reply.reason)}")
    if isinstance(reply, wire.Busy):
        if proofs.busy_proof_matches(token, nonce, agent_nonce, worker_id, reply.reason, reply.proof):
            return Ended(End.BUSY, cut(reply.reason, MAX_PROVEN_REASON))
        return unproven_busy(at, reply)
    if not isinstance(reply, wire.Welcome):
        return Ended(End.LOST, f"protocol error: expected welcome, got {reply.TYPE}")
    if not proofs.authority_proof_matches(token, nonce, agent_nonce, worker_id, reply.proof):
        log.error("%s did not prove the cluster token in its welcome: not the authority, or another token; "
                  "dropped it", at)
        return Ended(End.LOST, "the authority did not prove the cluster token")
    return None


def unproven_busy(at: str, busy: wire.Busy) -> Ended:
    """A Busy without its proof: anyone at the authority's address can send one (and send it for ever), so it is
    obeyed as a failed connect is, counted toward the crash-loop limit, never waited out as a proven one."""
    log.warning("%s said busy without proving the cluster token (%s): counted as a failed connect", at,
                echo(busy.reason))
    return Ended(End.LOST, f"busy without proof: {echo(busy.reason)}")


class Patience:
    """The waits the authority asked for, between dials: jittered (agents turned away together spread),
    bounded by :data:`WAIT_POLICY`, and for transient refusals a deadline since the first of an unbroken run."""

    def __init__(self) -> None:
        self.waits = 0
        self.since: dict[End, float] = {}  # when the unbroken run of each kind with a deadline began

    def reset(self) -> None:
        """Anything else ended a dial (a registration, a lost connection): a fresh run of waits starts after it."""
        self.waits = 0
        self.since.clear()

    def registered(self) -> None:
        """A registration ended with the authority gone: the runs of dials before it are broken (their deadlines start
        afresh), and the waits keep growing, so that an authority that takes the agent and goes again and again is
        dialed at the waits' pace (:data:`WAIT_POLICY`, at most one dial in its ``max_delay``), never in a loop."""
        self.since.clear()

    def delay(self, ended: Ended, now: float) -> float | None:
        """Seconds to wait before dialing again, or None: transient refusals, or dials that reach no authority,
        have lasted past their deadline."""
        deadline = DIAL_DEADLINES.get(ended.kind)
        if deadline is not None:
            began = self.since.setdefault(ended.kind, now)
            if now - began > deadline:
                return None
        self.waits += 1
        return WAIT_POLICY.delay(self.waits) * random.uniform(0.5, 1.0)


DIAL_DEADLINES = {End.TRANSIENT: TRANSIENT_DEADLINE, End.UNREACHABLE: UNREACHABLE_DEADLINE,
                  End.NOT_AN_AUTHORITY: NOT_AN_AUTHORITY_DEADLINE}


#: the ends of a dial or registration after which the agent dials again without counting it toward giving up
UNCOUNTED = frozenset({End.AUTHORITY_STOPPED, End.AUTHORITY_GONE, End.FENCED, End.BUSY, End.TRANSIENT,
                       End.UNREACHABLE, End.NOT_AN_AUTHORITY})

def patience_of(kind: End) -> str:
    """How long the agent keeps dialing after this kind of end, in words (the words "not counted" alone read as for
    ever, and an unreachable authority ends the agent after 300 s)."""
    deadline = DIAL_DEADLINES.get(kind)
    if deadline is None:  # (it said "waited out however long it lasts", and the next line, unreachable, 300 s)
        return (f"not counted as a crash; dialed again while it lasts, and given up after {UNREACHABLE_DEADLINE:g} s "
                f"of dials that reach no authority")
    return f"not counted as a crash; the agent gives up after {deadline:g} s of such dials"


#: the ends of a registration that the agent dials again after uncounted, at the waits' pace, and why they are no crash
UNCOUNTED_REGISTRATIONS = {End.AUTHORITY_GONE: "the authority went, not this worker",
                           End.FENCED: "a fence is the authority's silence or verdict, not this worker failing"}

#: what each kind of waited dial says the authority did
WAITED = {End.AUTHORITY_STOPPED: "stopped (it said goodbye)",
          End.AUTHORITY_GONE: "went away without a word (killed, or it crashed)",
          End.FENCED: "fenced this worker (it acknowledged no heartbeat in time, or lost it on the heartbeat clock)",
          End.BUSY: "is busy",
          End.TRANSIENT: "refused this worker for now", End.UNREACHABLE: "is unreachable",
          End.NOT_AN_AUTHORITY: "answers, but not as a chunkline authority"}  # its reason says what to check


class DialLog:
    """An agent's lines about its waited dials: the first of each kind at once, then one line with the count at most
    every :data:`DIAL_LOG_EVERY` seconds (:class:`~server.log_pace.LogPace`), and the count once it registers."""

    def __init__(self, at: str) -> None:
        self.at = at
        self.paces: dict[End, LogPace] = {}
        self.dials = 0  # waited dials since the last registration
        self.since = 0.0  # when the first of them ended
        # a refusal nobody proved (another token), and the counted restart after it: the same two lines each dial
        # until the crash-loop limit (18 lines for a wrong token); the first of each, then at most one every
        # DIAL_LOG_EVERY with a count of those left out
        self.unproven = LogPace(log, burst=1, per_second=1 / DIAL_LOG_EVERY)
        self.unproven_restarts = LogPace(log, burst=1, per_second=1 / DIAL_LOG_EVERY)
        # an authority that goes (or fences this worker) again and again: each time after a registration, so its pace,
        # one per kind, outlives them
        self.ended_registrations = {kind: LogPace(log, burst=1, per_second=1 / DIAL_LOG_EVERY)
                                    for kind in UNCOUNTED_REGISTRATIONS}

    def waiting(self, ended: Ended, delay: float, now: float) -> None:
        """A waited dial ended (``ended.why`` is the authority's own proven reason, cut, or this side's words)."""
        if ended.kind in UNCOUNTED_REGISTRATIONS:
            self.ended_registrations[ended.kind].warning(
                "agent at %s: the authority %s (%s); dialing again in %.1f s (not counted as a crash: %s)", self.at,
                WAITED[ended.kind], ended.why, delay, UNCOUNTED_REGISTRATIONS[ended.kind])
            return
        if not self.dials:
            self.since = now
        self.dials += 1
        pace = self.paces.setdefault(ended.kind, LogPace(log, burst=1, per_second=1 / DIAL_LOG_EVERY))
        pace.warning("agent at %s: the authority %s (%s); %d dials in %.0f s have not registered; dialing again in "
                     "%.1f s (%s)", self.at, WAITED[ended.kind], ended.why, self.dials, now - self.since, delay,
                     patience_of(ended.kind))

    def registered(self, now: float) -> str:
        """What a registration line adds of the waited dials before it (and a fresh count starts)."""
        if not self.dials:
            return ""
        said = f" after {self.dials} dials over {now - self.since:.0f} s that did not register"
        self.dials = 0
        self.paces.clear()
        return said
