"""A drained agent's slot stays down whichever notice reaches the authority first: its process exit (the
launcher's) or its goodbye (the socket's). The order is forced here, the exit first, for both launchers that
start agents: the test is the authority (speaking the wire to a real agent that the real ``LocalLauncher``
starts, or that the real ``RayLauncher`` places on a local Ray), and it holds the agent's goodbye until the
launcher has seen the exit (the local one reaped the process; Ray's actor returned its exit code, which the
slot's view shows as ``ended``) and run to its next wait; only then does it settle the worker as the authority
does on a goodbye. Before the launchers waited for that settling, the launcher took the clean exit for a loss
("process exited with code 0") and started the slot again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from server.cluster import wire
from server.cluster.launch_local import LocalLauncher
from server.cluster.launch_ray import RayLauncher
from server.cluster.remote import RemoteWorker
from server.settings import ServerSettings
from states.stream_session import DrainCause

from .conftest import TINY, TOKEN
from .test_hostile_authority import START_DEADLINE, serve, welcome


class Liveness:
    deadline = 30.0


class Runtime:
    settings = ServerSettings(pipeline=TINY, skip_validation=True)


class Authority:
    """What the launcher sees of the authority: its settings, address, token and the loss notice, which it
    settles as the authority does (a worker still registered is lost, and the launcher told so)."""

    def __init__(self, port: int) -> None:
        self.runtime = Runtime()
        self.authority_url = f"tcp://127.0.0.1:{port}"
        self.token = TOKEN
        self.liveness = Liveness()
        self.launcher: LocalLauncher | RayLauncher | None = None
        self.registered: dict[str, RemoteWorker] = {}
        self.losses: list[tuple[str, str]] = []
        self.stayed_down: list[tuple[DrainCause, str]] = []

    def lose(self, worker_id: str, cause: str) -> None:
        worker = self.registered.pop(worker_id, None)
        if worker is not None and self.launcher is not None:
            self.losses.append((worker_id, cause))
            self.launcher.worker_lost(worker, cause)

    def slot_stays_down(self, cause: DrainCause, reason: str) -> None:
        """A slot that stays down is told to the authority (which ends a queue nothing will run; none here)."""
        self.stayed_down.append((cause, reason))

    def left(self, worker: RemoteWorker) -> None:
        """The goodbye of a drained worker, settled: the worker leaves, and the launcher is told so."""
        if self.registered.pop(worker.worker_id, None) is not None and self.launcher is not None:
            self.launcher.worker_left(worker)


async def until(predicate: Any, what: str, deadline: float) -> None:
    with trio.fail_after(deadline):
        while not predicate():
            await trio.sleep(0.05)  # bench-cost: real-time poll of the agent process, bounded by a deadline


async def exit_before_goodbye(launcher: LocalLauncher | RayLauncher, exit_seen: Callable[[], bool]) -> Authority:
    """Run ``launcher`` for one slot whose agent drains at once; its goodbye is settled only once ``exit_seen``
    says the launcher saw the agent exit and every task waits. Returns the authority once the slot is settled."""
    goodbye_held = trio.Event()
    settled = trio.Event()

    async def one(stream: trio.SocketStream) -> None:
        channel = wire.Channel(stream)
        register = await welcome(channel, TOKEN)
        worker = RemoteWorker(register.worker_id, channel=channel, node=register.node, devices=register.devices,
                              launcher=register.launcher, pid=register.pid, slot=register.slot)
        authority.registered[worker.worker_id] = worker
        launcher.worker_registered(worker)
        try:
            while not isinstance(message := await channel.receive(), wire.Goodbye):
                if isinstance(message, wire.Ready):
                    await channel.send(wire.Drain(1.0))  # no sessions: it says goodbye at once, then exits 0
                elif isinstance(message, wire.Heartbeat):
                    await channel.send(wire.HeartbeatAck(message.seq))
        except wire.ConnectionClosed:
            return
        goodbye_held.set()
        # the exit first: the launcher sees the agent's end and runs until it waits again; then the goodbye
        await until(exit_seen, "the launcher to see the drained agent exit", 60)
        await trio.testing.wait_all_tasks_blocked()
        authority.left(worker)
        await trio.testing.wait_all_tasks_blocked()
        settled.set()

    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, one)
        authority = Authority(port)
        authority.launcher = launcher
        nursery.start_soon(launcher.run, authority)
        try:
            with trio.fail_after(START_DEADLINE):
                await settled.wait()
                # the slot's end settled (a Ray slot releases its actor and group in a thread first)
                await until(lambda: launcher.view()[0]["state"] == "stopped" or bool(authority.losses),
                            "the slot to settle", 60)
            assert goodbye_held.is_set()
        finally:
            nursery.cancel_scope.cancel()
    return authority


async def test_a_drained_agent_whose_exit_is_seen_before_its_goodbye_is_not_started_again() -> None:
    launcher = LocalLauncher([()])
    authority = await exit_before_goodbye(launcher, lambda: launcher.view()[0]["pid"] is None)
    assert authority.losses == [], authority.losses  # the clean exit was not taken for a loss
    [slot] = launcher.view()
    assert slot["state"] == "stopped" and slot["worker_id"] is None, slot  # drained: it stays down
    assert [cause for cause, _ in authority.stayed_down] == [DrainCause.WORKER_DRAIN]  # and the authority is told
    assert len(launcher.pids) == 1, launcher.pids  # and no agent was started in its place


@pytest.mark.ray
async def test_a_drained_ray_placed_agent_whose_exit_is_seen_before_its_goodbye_is_not_placed_again() -> None:
    """The same order through the Ray launcher, on a local Ray this process starts (and shuts down)."""
    launcher = RayLauncher([()], address=None)
    authority = await exit_before_goodbye(launcher, lambda: launcher.view()[0]["ended"] == "process exited with code 0")
    assert authority.losses == [], authority.losses  # the clean exit was not taken for a loss
    [slot] = launcher.view()
    # drained: it stays down, its actor and placement group given back, and it is not placed again
    assert slot["state"] == "stopped" and slot["worker_id"] is None and not slot["placed"], slot
    assert [cause for cause, _ in authority.stayed_down] == [DrainCause.WORKER_DRAIN]  # and the authority is told
    assert slot["restarts"] == 0, slot
