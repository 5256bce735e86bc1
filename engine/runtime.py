"""Per-session bookkeeping of the orchestrator: slots, edge occupancy, readiness, frontiers.

Everything here is synchronous and runs under the scheduler core's lock (in the
trio thread, or on a stage's thread completing its call); the core is the only
caller that changes it. Counters are maintained incrementally so that an admission
check costs O(edges of one stage), not a scan of every session.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Any

import trio

from states import pipeline_session as table
from states.pipeline_session import CloseReason

from .blockers import Blocker
from .metrics import RunningSummary
from .reservations import SessionReservations
from .spec import StageOrdering, StageSpec
from .threads import WaitQueue

__all__ = ["Lane", "SeqSet", "Slot", "SessionRuntime", "METRICS_WINDOW"]

# Per-sequence stamps are kept for the most recent sequences only, so that a
# session streaming for hours holds bounded memory.
METRICS_WINDOW = 4096


def trim(stamps: OrderedDict) -> None:
    """Drop the oldest entries beyond the window (O(1) each: a plain dict's front scan is not)."""
    while len(stamps) > METRICS_WINDOW:
        stamps.popitem(last=False)


class SeqSet:
    """A set of sequence ids stored as a contiguous prefix plus the sparse rest."""

    __slots__ = ("below", "beyond")

    def __init__(self) -> None:
        self.below = 0  # every id < below is in the set
        self.beyond: set[int] = set()  # the ids in the set above ``below`` (read-only outside: the scheduler's hot checks)

    def add(self, seq: int) -> None:
        if seq == self.below and not self.beyond:  # the common case: a strict stage takes the next one
            self.below = seq + 1
            return
        if seq < self.below:
            return
        self.beyond.add(seq)
        while self.below in self.beyond:
            self.beyond.remove(self.below)
            self.below += 1

    def discard(self, seq: int) -> None:
        """Undo :meth:`add` (an admission the actor refused)."""
        if seq >= self.below:
            self.beyond.discard(seq)
            return
        self.beyond.update(range(seq + 1, self.below))
        self.below = seq

    def __contains__(self, seq: int) -> bool:
        return seq < self.below or seq in self.beyond

    def __bool__(self) -> bool:
        return self.below > 0 or bool(self.beyond)

    def highest(self) -> int:
        return max(self.beyond, default=self.below - 1)


class Slot:
    """One artifact value for one sequence, and the stages that still have to take it."""

    __slots__ = ("value", "consumers")

    def __init__(self, value: Any, consumers: set[str]) -> None:
        self.value = value
        self.consumers = consumers

    def __repr__(self) -> str:
        return f"Slot(value={self.value!r}, consumers={self.consumers!r})"


class _Timing:
    """When one (stage, sequence) had its inputs, was admitted, completed (a plain slotted record: made per call)."""

    __slots__ = ("inputs_ready_at", "admitted_at", "completed_at")

    def __init__(self) -> None:
        self.inputs_ready_at: float | None = None
        self.admitted_at: float | None = None
        self.completed_at: float | None = None


class Lane:
    """One session at one stage: what admission asks of it, resolved once rather than looked up by key."""

    __slots__ = ("rt", "stage", "ready", "taken", "strict")

    def __init__(self, rt: SessionRuntime, stage: StageSpec) -> None:
        self.rt = rt
        self.stage = stage
        self.ready: dict[int, _Timing] = {}  # seqs with every input present, each with its timing record
        self.taken = SeqSet()  # admitted (running or done)
        self.strict = stage.ordering is StageOrdering.PER_SESSION_STRICT  # takes sequence 0, 1, 2... in turn

    def next_ready(self) -> int | None:
        """The sequence the stage would take next for this session, if its inputs are all here."""
        ready = self.ready
        if self.strict:
            frontier = self.taken.below
            return frontier if frontier in ready else None
        return min(ready) if ready else None


class SessionRuntime:
    """All mutable state of one orchestrator session (one epoch)."""

    def __init__(self, session_id: str, epoch: int, final_sequence_id: int | None, stages: tuple[StageSpec, ...]) -> None:
        stage_ids = tuple(stage.stage_id for stage in stages)
        self.session_id = session_id
        self.epoch = epoch
        self.final_sequence_id = final_sequence_id
        self.machine = table.PipelineSessionMachine()
        self.error: BaseException | None = None
        self.cleanup_error: BaseException | None = None

        self.slots: dict[tuple[int, str], Slot] = {}
        self.occupancy: Counter[tuple[str, str]] = Counter()  # (artifact, target) -> waiting slots
        # inputs present per seq, of stages with several (plain dicts: a Counter's ``del`` is Python code)
        self.present: dict[str, dict[int, int]] = {s: {} for s in stage_ids}
        # per stage: the sequences ready (each with its timing record) and taken
        self.lanes: dict[str, Lane] = {stage.stage_id: Lane(self, stage) for stage in stages}
        self.highest_ingress = -1

        self.reservations = SessionReservations()  # changed only by the scheduler's UsageBook
        self.handoffs_queued = 0  # completions made on a stage's thread whose trio follow-ups have not run

        self.pending_outputs: dict[int, dict[str, Any]] = {}
        self.outputs: deque[tuple[int, dict[str, Any]]] = deque()
        self.next_emit = 0

        # per-sequence stamps of the recent window; the summaries and first stamps cover the whole session
        self.ingress_at: OrderedDict[int, float] = OrderedDict()
        self.emitted_at: OrderedDict[int, float] = OrderedDict()
        self.first_ingress_at: float | None = None
        self.first_emitted_at: float | None = None
        self.last_emitted_at: float | None = None
        self.control_to_output = RunningSummary(METRICS_WINDOW)
        self.chunk_period = RunningSummary(METRICS_WINDOW)
        self.timings: dict[str, OrderedDict[int, _Timing]] = {s: OrderedDict() for s in stage_ids}
        self.missing_after: dict[str, OrderedDict[int, tuple[str, ...]]] = {s: OrderedDict() for s in stage_ids}
        self.blockers: dict[str, OrderedDict[int, Blocker]] = {s: OrderedDict() for s in stage_ids}

        self.cleaned: set[str] = set()
        self.phases: list[tuple[str, str]] = []  # (phase, outcome) as shutdown proceeds
        self.lifecycle_lock = trio.Lock()
        # separate wait queues, so a completion wakes only who can use it (and, on a stage's
        # thread, hands trio nothing when nobody waits); waits go through the core's lock
        self.room = WaitQueue()  # pushers: an ingress slot was consumed
        self.emitted = WaitQueue()  # output readers: an output was emitted
        self.changed = WaitQueue()  # shutdown and idle waits: any progress
        self.everyone = (self.room, self.emitted, self.changed)
        self.settled = trio.Event()  # terminal or poisoned

    # -- status ------------------------------------------------------------

    @property
    def state(self) -> table.State:
        return self.machine.state

    @property
    def admitting(self) -> bool:
        return self.machine.admitting

    @property
    def starting_accepted_work(self) -> bool:
        return self.machine.starting_accepted_work

    @property
    def hook_reason(self) -> CloseReason:
        return self.machine.hook_reason

    @property
    def all_emitted(self) -> bool:
        return self.final_sequence_id is not None and self.next_emit > self.final_sequence_id

    def wake(self) -> None:
        """In trio: the session's state changed, everyone re-checks."""
        for queue in self.everyone:
            queue.wake()

    def next_ready(self, stage: StageSpec) -> int | None:
        """The sequence ``stage`` would take next for this session, if its inputs are all here."""
        return self.lanes[stage.stage_id].next_ready()

    # -- slots -------------------------------------------------------------

    def add_slot(self, seq: int, artifact: str, value: Any, consumers: tuple[str, ...], now: float, consumes: dict[str, frozenset[str]]) -> None:
        self.slots[(seq, artifact)] = Slot(value, set(consumers))
        occupancy = self.occupancy
        for stage_id in consumers:
            edge = (artifact, stage_id)
            occupancy[edge] = occupancy.get(edge, 0) + 1  # plain dict calls: Counter's hooks are Python code
            needed = len(consumes[stage_id])
            if needed > 1:  # a stage with one input is ready at once
                present = self.present[stage_id]
                count = present.get(seq, 0) + 1
                if count < needed:
                    present[seq] = count
                    continue
                del present[seq]
            # the (stage, sequence) timing record: made here, when its inputs are all present
            timings = self.timings[stage_id]
            timing = timings.get(seq)
            if timing is None:
                timing = timings[seq] = _Timing()
                if len(timings) > METRICS_WINDOW:
                    trim(timings)
                    trim(self.missing_after[stage_id])
                    trim(self.blockers[stage_id])
            timing.inputs_ready_at = now
            self.lanes[stage_id].ready[seq] = timing

    def take_inputs(self, stage_id: str, seq: int, consumes: frozenset[str]) -> tuple[dict[str, Any], _Timing]:
        """Remove ``stage_id`` from each input slot's consumers (freeing the slot when empty).

        Returns the inputs and the (stage, sequence) timing record.
        """
        timing = self.lanes[stage_id].ready.pop(seq)
        inputs = {}
        slots, occupancy = self.slots, self.occupancy
        for artifact in consumes:
            slot = slots[(seq, artifact)]
            inputs[artifact] = slot.value
            consumers = slot.consumers
            consumers.discard(stage_id)
            occupancy[(artifact, stage_id)] -= 1
            if not consumers:
                del slots[(seq, artifact)]
        return inputs, timing

    def restore_inputs(self, stage_id: str, seq: int, inputs: dict[str, Any], timing: _Timing) -> None:
        """Undo :meth:`take_inputs` (the actor refused the invocation)."""
        for artifact, value in inputs.items():
            slot = self.slots.get((seq, artifact))
            if slot is None:
                slot = self.slots[(seq, artifact)] = Slot(value, set())
            slot.consumers.add(stage_id)
            self.occupancy[(artifact, stage_id)] += 1
        self.lanes[stage_id].ready[seq] = timing

    def discard_buffers(self) -> int:
        """Drop every buffered artifact and not-yet-polled output; returns slots dropped."""
        dropped = len(self.slots)
        self.slots.clear()
        self.occupancy.clear()
        for stage_id, lane in self.lanes.items():
            lane.ready.clear()
            self.present[stage_id].clear()
        self.pending_outputs.clear()
        return dropped

    def record_ingress(self, seq: int, now: float) -> None:
        if seq in self.ingress_at:
            return
        if self.first_ingress_at is None:
            self.first_ingress_at = now
        self.ingress_at[seq] = now
        if len(self.ingress_at) > METRICS_WINDOW:
            trim(self.ingress_at)

    def record_emitted(self, seq: int, now: float) -> None:
        if self.first_emitted_at is None:
            self.first_emitted_at = now
        if self.last_emitted_at is not None:
            self.chunk_period.add(now - self.last_emitted_at)
        self.last_emitted_at = now
        accepted = self.ingress_at.get(seq)
        if accepted is not None:
            self.control_to_output.add(now - accepted)
        self.emitted_at[seq] = now
        if len(self.emitted_at) > METRICS_WINDOW:
            trim(self.emitted_at)

    def leaked_slots(self) -> int:
        """Artifact slots and reservations still held after every stage released the session."""
        # a leaked slot usually leaves its occupancy count behind too: count it once
        leaks = max(len(self.slots), sum(1 for count in self.occupancy.values() if count))
        return leaks + len(self.reservations) + self.reservations.drift()
