"""Stage threads and the trio thread: one wake-up per hop, none lost, none wasted.

A synchronous handler's call ends on its actor's thread, which completes it in the
scheduler core and submits the next stage from there. The trio thread is woken only
when a trio task waits for what changed, and several threads finishing together wake
it once (``TrioInbox``). These tests drive real stage threads through the public API;
they synchronise through ``threading.Event`` gates and ``wait_all_tasks_blocked``.
"""

from __future__ import annotations

import threading
import time

import trio
import trio.testing

from engine import LocalStageActor, open_orchestrator
from engine.threads import TrioInbox

from .conftest import canonical_spec, chunk

SAFETY = 30.0  # a broken test fails instead of hanging


def sync_actors(gate: threading.Event | None = None, at_gate: threading.Event | None = None) -> dict[str, LocalStageActor]:
    def decode(inv):
        if at_gate is not None:
            at_gate.set()
        if gate is not None:
            assert gate.wait(SAFETY)
        return {"frames": (inv.key.session_id, inv.key.sequence_id, inv.inputs["latent"])}

    return {
        "encode": LocalStageActor(lambda inv: {"condition": inv.inputs["image"]}, name="encode"),
        "denoise": LocalStageActor(lambda inv: {"latent": (inv.inputs["condition"], inv.inputs["control"])}, name="denoise"),
        "decode": LocalStageActor(decode, name="decode"),
    }


def one_chunk_with_reader(orch):
    """A session with its one chunk pushed, the list its reader fills, and the reader."""
    session = orch.create_session("s", final_sequence_id=0)
    assert session.try_push(0, chunk(0))
    got: list = []

    async def read() -> None:
        async for item in session.outputs():
            got.append(item)

    return session, got, read


async def test_stage_threads_wake_trio_only_for_a_task_that_waits():
    gate = threading.Event()
    async with open_orchestrator(canonical_spec(), sync_actors(gate)) as orch:
        inbox = TrioInbox.current()
        session, got, read = one_chunk_with_reader(orch)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()  # the reader waits for an output
            before = inbox.batches
            gate.set()  # encode and denoise ended on their threads with nobody waiting on them
        assert [seq for seq, _ in got] == [0]
        assert inbox.batches - before == 1  # decode's output woke the reader; nothing else woke trio
        await session.aclose()


async def test_calls_posted_while_trio_is_busy_run_in_one_batch():
    inbox = TrioInbox.current()
    ran: list[int] = []
    before = inbox.batches

    def post_three() -> None:
        for i in range(3):
            inbox.post(ran.append, i)

    thread = threading.Thread(target=post_three)
    thread.start()
    thread.join()  # the trio thread is held here: all three posts wait for one batch
    while len(ran) < 3:
        await trio.lowlevel.checkpoint()
    assert ran == [0, 1, 2]
    assert inbox.batches - before == 1


async def test_no_wake_up_is_lost_between_threads_and_waiting_tasks():
    """Pushers, readers, idle waits and barriers race stage threads over many chunks."""
    chunks, sessions = 200, 3
    with trio.fail_after(SAFETY):
        async with open_orchestrator(canonical_spec(), sync_actors()) as orch:
            handles = [orch.create_session(f"s{i}", final_sequence_id=chunks - 1) for i in range(sessions)]
            seen: dict[str, list[int]] = {h.session_id: [] for h in handles}

            async def push(handle) -> None:
                for seq in range(chunks):
                    await handle.push(seq, chunk(seq))
                    if seq % 50 == 0:
                        await handle.wait_until_idle()

            async def read(handle) -> None:
                async for seq, artifacts in handle.outputs():
                    assert artifacts["frames"][:2] == (handle.session_id, seq)
                    seen[handle.session_id].append(seq)
                    if seq % 64 == 0:
                        await orch.barrier()

            async def stream(handle) -> None:
                async with trio.open_nursery() as both:
                    both.start_soon(push, handle)
                    both.start_soon(read, handle)
                await handle.aclose()

            async with trio.open_nursery() as nursery:
                for handle in handles:
                    nursery.start_soon(stream, handle)
            await orch.barrier()
    assert all(order == list(range(chunks)) for order in seen.values())
    assert orch.diagnostics().slot_leaks == 0


async def test_a_session_is_not_idle_while_its_completions_trio_side_is_queued():
    """A call that ended on its thread counts as in flight until trio has run what it left.

    The trio thread is held (synchronously) until decode's thread has completed the call in
    the core: the reservation is gone then, but the reader's wake-up has not run yet, so the
    session must not look idle (a quiescence check would see an output nobody was woken for).
    """
    gate, at_gate = threading.Event(), threading.Event()
    async with open_orchestrator(canonical_spec(), sync_actors(gate, at_gate)) as orch:
        session, got, read = one_chunk_with_reader(orch)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()  # the reader waits
            await trio.to_thread.run_sync(at_gate.wait, SAFETY)  # decode's call runs, held at its gate
            await trio.testing.wait_all_tasks_blocked()
            assert orch.in_flight("decode") == 1 and session.in_flight == 1
            gate.set()
            deadline = time.monotonic() + SAFETY
            while orch.in_flight("decode"):  # the trio thread does not yield: decode's thread completes
                assert time.monotonic() < deadline, "decode's call never completed"
            assert got == []
            assert session.in_flight == 1  # completed on its thread, the reader's wake-up still queued
            await session.wait_until_idle()
            assert session.in_flight == 0
            await trio.testing.wait_all_tasks_blocked()
            assert [seq for seq, _ in got] == [0]
        await session.aclose()
