"""``--workers local``: one agent process per worker slot on this host, replaced when lost.

Slots are ``--num-workers`` (or one per ``--worker-gpu-map`` group, whose GPUs the agent
gets as ``--devices`` and ``CUDA_VISIBLE_DEVICES``). A slot whose process exits is started
again after the shared restart policy's backoff (:mod:`states.restart_policy`, the one the
in-process worker restarts use), and gives up after a crash loop. A slot whose worker the authority lost while the process lives on (frozen, cut
off) gets one heartbeat deadline to register again by itself; then it is killed and
replaced. At shutdown every agent gets SIGTERM, then SIGKILL after a grace.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import trio

from states.restart_policy import RestartPolicy, RestartTracker
from states.stream_session import DrainCause

from ..gpu_devices import agent_devices
from ..reasons import echo
from ..server_folders import ServerFolder
from . import wire
from .backoff import EXIT_REFUSED, await_goodbye, back_off, stays_down
from .launcher_slots import SlotLauncher
from .load_failures import LOAD_FAILURE_ENV, read_load_failure

if TYPE_CHECKING:
    from .authority import ClusterAuthority
    from .remote import RemoteWorker

__all__ = ["LocalLauncher", "agent_command", "exit_cause"]

log = logging.getLogger("chunkline.cluster")

TERMINATE_GRACE = 5.0
REREGISTER_WINDOW = 10.0  # a lost agent whose process lives may register again (fresh id) within this


def exit_cause(returncode: int) -> str:
    """How a launcher saw its agent's process end: its exit code, or the signal that ended it (a negative
    return code is no exit code: it read "exited with code -9" for a SIGKILL)."""
    if returncode >= 0:
        return f"process exited with code {returncode}"
    try:
        name = f" ({signal.Signals(-returncode).name})"
    except ValueError:
        name = ""
    return f"process exited: killed by signal {-returncode}{name}"


def agent_command(
    pipeline: str,
    authority_url: str,
    *,
    devices: Sequence[int],
    launcher: str,
    slot: str,
    max_sessions: int | str,
    worker_mode: str,
    placement: str | None,
    control_idle_timeout: float,
    default_fps: float,
    skip_validation: bool,
    launcher_pid: int | None = None,
    tls_certificate: str | None = None,
) -> list[str]:
    """The agent's command line: the authority's settings that its own workers would get, its slot's devices.

    ``launcher_pid``: the agent is this process's child and ends when it is gone (``--workers local``).
    ``tls_certificate``: the authority's own certificate (``--cluster-tls-cert``), which the agent trusts
    (``--tls-ca``): a self-signed one, or one of a private CA, is in no system store.
    """
    command = [sys.executable, "-m", "server.cli", "worker", pipeline, "--authority", authority_url,
               "--launcher", launcher, "--slot", slot, "--max-sessions", str(max_sessions),
               "--worker-mode", worker_mode, "--control-idle-timeout", repr(control_idle_timeout),
               "--default-fps", repr(default_fps)]
    if skip_validation:
        command.append("--skip-validation")
    if devices:
        command += ["--devices", ",".join(str(d) for d in devices)]
    if placement is not None:
        command += ["--placement", placement]
    if launcher_pid is not None:
        command += ["--launcher-pid", str(launcher_pid)]
    if tls_certificate is not None:
        command += ["--tls-ca", os.path.abspath(tls_certificate)]
    return command


async def _terminate_then_kill(process: trio.Process) -> None:
    process.send_signal(signal.SIGTERM)
    with trio.move_on_after(TERMINATE_GRACE):
        await process.wait()
        return
    process.kill()


@attrs.define(eq=False)
class _Slot:
    name: str
    devices: tuple[int, ...]
    restarts: RestartTracker
    process: trio.Process | None = None
    worker_id: str | None = None
    lost: trio.Event = attrs.Factory(trio.Event)
    registered: trio.Event = attrs.Factory(trio.Event)
    settled: trio.Event = attrs.Factory(trio.Event)  # its registered worker left or was lost
    drained: bool = False


class LocalLauncher(SlotLauncher):
    name = "local"

    def __init__(self, groups: Sequence[tuple[int, ...]], *, policy: RestartPolicy | None = None) -> None:
        self.slots = [_Slot(str(i), tuple(g), RestartTracker(policy)) for i, g in enumerate(groups)]
        self.expected = len(self.slots)
        self._authority: ClusterAuthority | None = None
        self.pids: list[int] = []  # every agent process started (tests check none survives)
        self._folder = ServerFolder("launcher")  # where each slot's agent tells a failed load (made by run())

    async def run(self, authority: ClusterAuthority, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._authority = authority
        self._folder.make()
        try:
            async with trio.open_nursery() as nursery:
                for slot in self.slots:
                    nursery.start_soon(self._keep, slot)
                task_status.started()
        finally:
            self._folder.remove()

    def _load_failure_file(self, slot: _Slot) -> str:
        return os.path.join(self._folder.make(), f"slot-{slot.name}.json")  # made again if a cleaner took it

    def _command(self, slot: _Slot) -> list[str]:
        assert self._authority is not None
        settings = self._authority.runtime.settings
        return agent_command(
            settings.pipeline, self._authority.authority_url, devices=agent_devices(slot.devices)[1], launcher=self.name,
            slot=slot.name, max_sessions=settings.max_sessions_per_worker, worker_mode=settings.worker_mode,
            placement=settings.placement, control_idle_timeout=settings.control_idle_timeout,
            default_fps=settings.default_fps, skip_validation=settings.skip_validation, launcher_pid=os.getpid(),
            tls_certificate=settings.cluster_tls_cert,
        )

    def _pipeline(self) -> str | None:
        return None if self._authority is None else self._authority.runtime.settings.pipeline

    def _env(self, slot: _Slot) -> dict[str, str]:
        assert self._authority is not None
        env = dict(os.environ)
        env["CHUNKLINE_CLUSTER_TOKEN"] = self._authority.token
        env[LOAD_FAILURE_ENV] = self._load_failure_file(slot)
        if slot.devices:  # the group as this process sees it: the agent sees it alone, from its GPU 0
            env["CUDA_VISIBLE_DEVICES"] = agent_devices(slot.devices)[0]
        return env

    async def _keep(self, slot: _Slot) -> None:
        """Run the slot's agent; replace it with backoff when it ends; give up on a crash loop."""
        while True:
            slot.lost = trio.Event()
            async with trio.open_nursery() as nursery:
                process: trio.Process = await nursery.start(
                    partial(trio.run_process, self._command(slot), env=self._env(slot), check=False,
                            stdin=subprocess.DEVNULL, deliver_cancel=_terminate_then_kill)
                )
                slot.process = process
                self.pids.append(process.pid)
                nursery.start_soon(self._reap_if_silent, slot, process)
                await process.wait()
                nursery.cancel_scope.cancel()  # the reaper has nothing left to watch
            why = exit_cause(process.returncode)
            if slot.worker_id is not None:
                await await_goodbye(slot.settled, process.returncode == 0)
            if slot.worker_id is not None and self._authority is not None:
                self._authority.lose(slot.worker_id, why)  # the process notice may beat the socket's
            slot.worker_id = None
            if slot.drained and process.returncode == 0:
                slot.restarts.stop()  # drained on purpose: its resources are back, nothing to replace
                log.info("local slot %s: drained; it stays down", slot.name)
                stays_down(self._authority, slot.restarts, f"local slot {slot.name}")
                return
            # an agent that never loaded said how its load failed: a repeat gives the slot up (states.restart_policy)
            failure = read_load_failure(self._load_failure_file(slot))
            if not await back_off(slot.restarts, why, f"local slot {slot.name}",
                                  permanent=process.returncode == EXIT_REFUSED, load_failure=failure,
                                  pipeline=self._pipeline()):
                stays_down(self._authority, slot.restarts, f"local slot {slot.name}", DrainCause.WORKER_FAILED)
                return
            if self._authority is not None:
                self._authority.runtime.metrics.record_worker_restart()

    async def _reap_if_silent(self, slot: _Slot, process: trio.Process) -> None:
        """A lost worker whose process lives on gets one deadline to register again, then is killed."""
        assert self._authority is not None
        while True:
            await slot.lost.wait()
            slot.lost = trio.Event()
            slot.registered = trio.Event()
            with trio.move_on_after(self._reregister_window()):
                await slot.registered.wait()
                continue
            if process.returncode is None:
                log.warning("local slot %s: lost and silent; killing pid %d", slot.name, process.pid)
                process.kill()
            return

    def _reregister_window(self) -> float:
        """Seconds a lost agent whose process lives on has to register again before it is killed."""
        assert self._authority is not None
        return max(self._authority.liveness.deadline, REREGISTER_WINDOW)

    # -- the authority's notices --

    def refusal(self, register: wire.Register) -> str | None:
        """Why an agent that names this launcher is not one of its agents (None: it is, or names another).

        An agent of an earlier authority on this host (one killed with SIGKILL, whose agents lived on)
        names the same launcher and slots; taken in, it claimed a slot this launcher had filled, and the
        loss of the launcher's own agent then failed the stranger's sessions.
        """
        if register.launcher != self.name:
            return None
        slot = next((s for s in self.slots if s.name == register.slot), None)
        if slot is None:
            return f"this authority's local launcher has no slot {echo(register.slot)}"
        started = slot.process.pid if slot.process is not None and slot.process.returncode is None else None
        if register.pid != started:
            return (f"pid {register.pid} is not the agent this authority started for local slot {slot.name} "
                    f"(that is pid {started}); an agent of an earlier authority?")
        return None

    def worker_registered(self, worker: RemoteWorker) -> None:
        slot = self.slot_of(worker)
        if slot is not None:
            slot.restarts.loaded()  # an agent registers once it loaded: later failures are crashes, backed off
            slot.restarts.reregistered()  # a lost agent whose process lived on came back: running again
            slot.worker_id = worker.worker_id
            slot.settled = trio.Event()
            slot.registered.set()

    def worker_lost(self, worker: RemoteWorker, cause: str) -> None:
        slot = self.slot_of(worker)
        if slot is not None and slot.worker_id == worker.worker_id:
            slot.worker_id = None
            if slot.process is not None and slot.process.returncode is None:  # ended unless it registers again
                slot.restarts.worker_lost(cause, trio.current_time() + self._reregister_window())
            slot.settled.set()
            slot.lost.set()

    def view(self) -> list[dict[str, Any]]:
        return [
            {"slot": s.name, "devices": list(s.devices), "state": s.restarts.state.value, "worker_id": s.worker_id,
             "restarts": s.restarts.restarts, "reason": s.restarts.describe(trio.current_time()),
             "pid": s.process.pid if s.process is not None and s.process.returncode is None else None}
            for s in self.slots
        ]
