"""Hypothesis drives random push / poll / hold / cancel / close / injected failures across three
sessions on the three-stage graph, and checks the orchestrator's promises after every step."""

from __future__ import annotations

from functools import partial

import trio
import trio.testing
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from engine import LocalStageActor, open_orchestrator
from states.pipeline_session import State

from .conftest import canonical_spec

SESSIONS = ("a", "b", "c")
STAGES = ("encode", "denoise", "decode")
PRODUCES = {"encode": "condition", "denoise": "latent", "decode": "frames"}
SPEC = canonical_spec()  # the shared three-stage graph, capacity-2 edges


class InjectedFailure(Exception):
    pass


class Harness:
    """Gated async handlers that check edge bounds every time any stage runs."""

    def __init__(self) -> None:
        self.gates = {stage: None for stage in STAGES}  # stage -> trio.Event while held
        self.fail_next: set[tuple[str, str]] = set()  # (session, stage)
        self.violations: list[str] = []
        self.orch = None

    def check_edges(self) -> None:
        for sid in self.orch.session_ids:
            session = self.orch.get_session(sid)
            for edge in SPEC.edges:
                held = session.buffered(edge.artifact, edge.target_stage)
                if held > edge.capacity_per_session:
                    self.violations.append(f"{sid}: {edge.describe()} holds {held}")

    def handler(self, stage: str):
        async def handle(invocation):
            self.check_edges()
            gate = self.gates[stage]
            if gate is not None:
                await gate.wait()
            key = (invocation.key.session_id, stage)
            if key in self.fail_next:
                self.fail_next.discard(key)
                raise InjectedFailure(f"{stage} failed for {key[0]}")
            return {PRODUCES[stage]: (invocation.key.session_id, invocation.key.sequence_id)}

        return handle


async def test_orchestrator_random_operations():
    harness = Harness()
    actors = {stage: LocalStageActor(harness.handler(stage), name=stage) for stage in STAGES}
    async with open_orchestrator(SPEC, actors) as orch:
        harness.orch = orch

        async def settle():
            await trio.testing.wait_all_tasks_blocked()

        def call(fn, *args):
            result = trio.from_thread.run(fn, *args)
            trio.from_thread.run(settle)
            return result

        class OrchestratorMachine(RuleBasedStateMachine):
            def __init__(self):
                super().__init__()
                self.handles = {}
                self.pushed = {}  # sid -> next seq to push
                self.received = {}  # sid -> list of seqs received
                self.ended = {}  # sid -> how it ended
                self.failures_injected = False
                for sid in SESSIONS:
                    self._open(sid)

            def _open(self, sid):
                self.handles[sid] = trio.from_thread.run_sync(orch.create_session, sid)
                self.pushed[sid] = 0
                self.received[sid] = []
                self.ended.pop(sid, None)

            def _live(self, sid):
                return sid not in self.ended

            @rule(sid=st.sampled_from(SESSIONS))
            def push(self, sid):
                if not self._live(sid):
                    return
                handle = self.handles[sid]
                seq = self.pushed[sid]
                accepted = call(self._try_push, handle, seq)
                if accepted:
                    self.pushed[sid] += 1

            @staticmethod
            async def _try_push(handle, seq):
                if handle.status is not State.RUNNING:
                    return False
                return handle.try_push(seq, {"image": seq, "control": seq})

            @rule(sid=st.sampled_from(SESSIONS))
            def poll(self, sid):
                items = call(self._poll, self.handles[sid])
                if sid in self.ended and self.ended[sid] == "cancelled":
                    assert items == [], f"{sid} emitted {items} after its cancel"
                for seq, artifacts in items:
                    assert artifacts == {"frames": (sid, seq)}
                    self.received[sid].append(seq)

            @staticmethod
            async def _poll(handle):
                return handle.poll_outputs()

            @rule(stage=st.sampled_from(STAGES))
            def hold(self, stage):
                if harness.gates[stage] is None:
                    harness.gates[stage] = trio.from_thread.run_sync(trio.Event)

            @rule(stage=st.sampled_from(STAGES))
            def release(self, stage):
                gate = harness.gates[stage]
                if gate is not None:
                    harness.gates[stage] = None
                    trio.from_thread.run_sync(gate.set)
                    trio.from_thread.run(settle)

            def _release_all(self):
                for stage in STAGES:
                    self.release(stage)

            @rule(sid=st.sampled_from(SESSIONS), stage=st.sampled_from(STAGES))
            def inject_failure(self, sid, stage):
                if self._live(sid):
                    harness.fail_next.add((sid, stage))
                    self.failures_injected = True

            @rule(sid=st.sampled_from(SESSIONS))
            def cancel(self, sid):
                if not self._live(sid):
                    return
                handle = self.handles[sid]
                self._release_all()  # a running call finishes; it is never interrupted
                call(handle.cancel)
                if handle.status is State.CANCELLED:
                    self.ended[sid] = "cancelled"
                else:
                    assert handle.status is State.FAILED, handle.status
                    self.ended[sid] = "failed"

            @rule(sid=st.sampled_from(SESSIONS))
            def close(self, sid):
                if not self._live(sid):
                    return
                handle = self.handles[sid]
                self._release_all()

                async def close_while_polling():
                    got = []
                    async with trio.open_nursery() as nursery:
                        async def reader():
                            async for item in handle.outputs():
                                got.append(item)
                        nursery.start_soon(reader)
                        await handle.aclose()
                        got.extend(handle.poll_outputs())
                    return got

                items = call(close_while_polling)
                for seq, _ in items:
                    self.received[sid].append(seq)
                if handle.status is State.CLOSED:
                    self.ended[sid] = "closed"
                    # a drained session delivers every sequence it accepted
                    assert self.received[sid] == list(range(self.pushed[sid])), (
                        sid, self.received[sid], self.pushed[sid])
                else:
                    assert handle.status is State.FAILED, handle.status
                    self.ended[sid] = "failed"

            @precondition(lambda self: any(sid in self.ended for sid in SESSIONS))
            @rule(sid=st.sampled_from(SESSIONS))
            def reopen(self, sid):
                if sid in self.ended:
                    trio.from_thread.run(self.handles[sid].wait_settled)
                    old_epoch = self.handles[sid].epoch
                    self._open(sid)
                    assert self.handles[sid].epoch > old_epoch

            @invariant()
            def outputs_in_order(self):
                for sid in SESSIONS:
                    got = self.received[sid]
                    assert got == list(range(len(got))), (sid, got)

            @invariant()
            def edges_bounded(self):
                trio.from_thread.run_sync(harness.check_edges)
                assert not harness.violations, harness.violations

            @invariant()
            def ended_sessions_hold_nothing(self):
                for sid, how in self.ended.items():
                    handle = self.handles[sid]
                    if handle.status in (State.CLOSED, State.CANCELLED, State.FAILED):
                        assert handle.in_flight == 0
                        assert handle.artifact_stats().slot_count == 0

            @invariant()
            def no_diagnostics(self):
                diag = trio.from_thread.run_sync(orch.diagnostics)
                assert diag.stale_epoch_results == diag.orphaned_results == diag.duplicate_results == 0
                assert diag.slot_leaks == 0
                assert diag.cleanup_failures == 0

            def teardown(self):
                self._release_all()
                harness.fail_next.clear()
                for sid in SESSIONS:
                    handle = self.handles[sid]
                    if self._live(sid):
                        call(handle.cancel)
                    trio.from_thread.run(handle.wait_settled)
                    assert handle.status in (State.CLOSED, State.CANCELLED, State.FAILED)
                    assert handle.in_flight == 0 and handle.artifact_stats().slot_count == 0
                assert trio.from_thread.run_sync(lambda: orch.session_ids) == ()
                for stage in STAGES:
                    assert trio.from_thread.run_sync(orch.in_flight, stage) == 0
                    assert trio.from_thread.run_sync(orch.actor_health, stage).pending_invocations == 0

        await trio.to_thread.run_sync(
            partial(
                run_state_machine_as_test,
                OrchestratorMachine,
                settings=settings(
                    max_examples=60,
                    stateful_step_count=30,
                    deadline=None,
                    derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow],
                ),
            )
        )
