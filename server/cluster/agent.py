"""The worker agent (``chunkline worker PIPE --authority URL``): a model worker that dials in.

One agent process holds one device group's model worker (service, lease, orchestrator),
its room runners and its transport, so media is published next to the model. It loads
its pipeline, dials the authority (no inbound port on the worker's host), registers under
a fresh id, reports the capacity of the pipeline it loaded first, and heartbeats; the
sessions the authority starts run in :class:`~server.cluster.agent_sessions.AgentSessions`,
whose table events go back over this connection in order.

Cut off from the authority (no heartbeat acknowledged), the agent *fences* itself at
:func:`states.liveness.fence_at` — before the authority's deadline — by stopping every
session it runs, then registers again under a new id with the model it already
loaded, not counting the fence toward its crash-loop limit (nor the authority's word that it lost the agent on the
heartbeat clock): the authority's silence or verdict is no crash of the agent's. The authority proves the cluster token back (its Welcome), and every frame after
that is tagged (see :mod:`server.cluster.wire`): a peer at the authority's address that
cannot prove it is dropped and dialed again after a backoff, as after any failed connect.
What the authority's answers make it do is :mod:`server.cluster.dial_ends`: a proven Busy (a
flood fills the authority's handshakes) or a proven transient refusal is waited out without
counting it toward giving up; a proven permanent refusal (another version or pipeline) exits
with code 3; anything unproven counts as a failed connect (a crash loop of unproven refusals
exits with code 3 too). An authority that stops in order says goodbye (a tagged frame, after its own drain): the
agent dials again without counting that close toward giving up; so it does, at the waits' pace, when the authority
goes without a word (killed or crashed: the connection closes or is reset, :func:`~server.cluster.dial_ends.vanished`).
SIGTERM, SIGINT or SIGHUP (or a drain from the authority) drains: no new sessions, live ones finish or are stopped at the
drain deadline at a chunk boundary, then it says goodbye and exits 0. A stop signal while it loads
its pipeline (or runs its startup check) ends it at once, its child processes and their shared
memory with it: nothing is there to drain, and a load cannot be cancelled. One before it served
(dialing) or while cut off ends it without saying ready; one while it is already leaving ends it
at once. What each signal and drain does, and the exit status, is :mod:`states.agent`'s table.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn

import trio

from engine import CapacityPlan
from states.agent import (
    LEAVING, ON_STOP_SIGNAL, WORKER_GONE, AgentMachine, Event, State, StopSignalAct, exit_status, start_refusal,
)
from states.restart_policy import RestartPolicy, RestartTracker

from .. import early_signals
from ..gpu_devices import ordinals_in_this_process
from ..metrics import ServerMetrics
from ..model_worker import ModelWorker
from ..option_check import CHECK_OPTIONS_TIMEOUT
from ..reasons import cut, public_reason
from ..requests import OptionsRefused, SessionImageRefused
from ..run_signals import exit_now, note_stop_signal
from ..server_folders import remove_stale_folders
from . import tls, wire
from .agent_drain import AgentDrain
from .agent_handshake import Shaken, handshake
from .agent_heartbeats import FENCED, HeartbeatClock
from .agent_options import AgentOptions, parse_authority
from .agent_sessions import RUNNER_STOP_GRACE, AgentSessions
from .backoff import EXIT_REFUSED, back_off
from .dial_ends import DIAL_DEADLINES, MAX_PROVEN_REASON, UNCOUNTED, WAITED, DialLog, End, Ended, Patience, vanished
from .identity import new_worker_id
from .launcher_watch import LAUNCHER_GONE_EXIT_CODE, launcher_gone
from .load_failures import LoadFailureNote

__all__ = ["AgentOptions", "Agent", "parse_authority", "EXIT_REFUSED"]

log = logging.getLogger("chunkline.agent")

OUTBOX = 1024
# an agent cut off from the authority registers again quickly at first, and gives up on a crash loop
REREGISTER_POLICY = RestartPolicy(base_delay=0.2, max_delay=5.0, max_failures=8, window=60.0)


class Agent:
    def __init__(self, options: AgentOptions, *, service_loader: Callable[..., Any] | None = None) -> None:
        self.options = options
        self.scheme, self.host, self.port = parse_authority(options.authority)
        self._tls = tls.client_tls_context(options.tls_ca) if self.scheme == "tls" else None
        self.metrics = ServerMetrics()
        extra = {} if service_loader is None else {"service_loader": service_loader}
        self.load_note = LoadFailureNote.from_environment()  # its launcher's word of the slot's last failed load
        self.worker = ModelWorker(
            "agent",
            pipeline=options.pipeline,
            gpu_ids=ordinals_in_this_process(options.devices),  # its CUDA_VISIBLE_DEVICES lists them
            max_sessions=options.max_sessions,
            on_ready=self._model_ready,
            on_failed=self._model_failed,
            worker_mode=options.worker_mode,
            placement=options.placement,
            # served to remote clients; the authority's assets directory is not this host's: no client paths
            offered={"control_idle_timeout": options.control_idle_timeout, "fps": options.default_fps,
                     "served": True, "assets_dir": None},
            validate=options.validate,
            new_load_failure=self.load_note.is_new,
            **extra,
        )
        self.worker_id: str | None = None
        self.dial_log = DialLog(options.authority)
        self.sessions = AgentSessions(self.worker, self.metrics, self.send)
        self._nursery: trio.Nursery | None = None
        self._ready: wire.Ready | None = None
        self._model_failure: str | None = None
        self._model_refused = False  # it refused this agent's settings: another agent would too
        self._model_settled = trio.Event()
        self._worker_failed = trio.Event()  # its model worker failed once loaded: it leaves (states.agent)
        self._outbox: trio.MemorySendChannel[wire.Message] | None = None
        self.life = AgentMachine()  # what a stop signal or a drain does: states.agent's table
        self._first_signal: int | None = None  # the first stop signal: the exit code may be 128 + it
        self._stop_scopes: set[trio.CancelScope] = set()  # waits a stop before serving ends
        self.drain = AgentDrain(self.sessions)  # its line in the log says who asked, and how it ended
        self.clock = HeartbeatClock()  # its heartbeats, their acknowledgements, the fence
        self._flushed = trio.Event()
        self._pump_scope = trio.CancelScope()
        self._registering = trio.CancelScope()  # cancelled when the launching authority is gone
        self._authority_goodbye: str | None = None  # how this registration ended when the authority said goodbye
        self._authority_gone: str | None = None  # how it ended when the authority's connection closed with no word
        self._fenced_by_authority: str | None = None  # how it ended when the authority lost it on the heartbeat clock

    # -- life --

    async def run(self) -> int:
        remove_stale_folders()  # what an agent killed on this host left (its replacement starts here, now)
        # open for the whole run, the wait for a pipeline still loading included: a second signal then ends the agent
        # (states.agent); closed before that wait, it put Python's default actions back, and the second signal
        # ended the process by itself (-15, or a KeyboardInterrupt traceback), leaving its children behind. SIGHUP (its
        # terminal closed) is a stop signal too, as under stream-serve and `chunkline run`: its default action ended
        # the agent at once, with no drain and its children left to their parent-death signal (ignored as the agent
        # started, as under nohup, it stays ignored: early_signals.stop_signals)
        with trio.open_signal_receiver(*early_signals.stop_signals()) as signals:
            early_signals.hand_over()  # the command's noting handlers (early_signals.defer) stay once this closes
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._signals, signals)
                code = await self._run()
                nursery.cancel_scope.cancel()
        # the receiver put back what it found: under `chunkline worker` the command's noting handlers
        # (early_signals.defer), so a signal from here on, the exit status decided, changes nothing
        note_stop_signal()  # nor in the interpreter's very last teardown (run_signals._teardown)
        self.sessions.close()
        self.life.apply(Event.END)
        self.drain.log_end(code)
        return code

    async def _run(self) -> int:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            # load before dialing: a model import that holds the interpreter must not
            # starve the heartbeats of a registered worker into a fence
            nursery.start_soon(self.worker.run)
            if self.options.launcher_pid is not None:  # watched from the start: a model may take minutes to load
                nursery.start_soon(self._watch_launcher, self.options.launcher_pid)
            await self._model_settled.wait()  # (a stop signal before then ends the agent at once: states.agent)
            if self.life.state in LEAVING:
                code = self._exit_code()
            elif self._ready is None and not self._registering.cancel_called:
                log.error("the model worker failed: %s", self._model_failure)
                self.load_note.tell(self.worker.load_failure)  # its launcher gives the slot up on a repeat
                code = EXIT_REFUSED if self._model_refused else 1
            else:
                with self._registering:
                    code = await self._registrations()
            if self._registering.cancel_called:  # the launching authority is gone
                code = LAUNCHER_GONE_EXIT_CODE
            await self.sessions.stop_all("agent exiting", hard=True)
            self.worker.stop()
            nursery.cancel_scope.cancel()  # a load under way is waited for (a stop signal ends it now: still LOADING)
        return code

    def _exit_code(self) -> int:
        """How an agent that is leaving exits: states.agent's one rule for every phase."""
        return exit_status(self.life.state, self._first_signal)

    async def _watch_launcher(self, pid: int) -> None:
        """The authority that started this agent died (kill -9 leaves its agents running): end with it.

        Left running, an agent dialed the dead authority's port for minutes holding its model, and
        registered with a restarted authority as one more worker of a slot that was already filled.
        """
        await launcher_gone(pid)
        log.error("the authority that started this agent (pid %d) is gone; exiting", pid)
        self._registering.cancel()
        self._model_settled.set()  # a model still loading is not waited for

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    async def _signals(self, signals: Any) -> None:
        early_signals.replay()  # one that came while the agent started: it stops the start too
        async for signum in signals:
            self._stop_signal(signum)

    def _stop_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        before = self.life.state
        act = ON_STOP_SIGNAL[self.life.apply(Event.STOP_SIGNAL)]
        if self._first_signal is None:
            self._first_signal = signum
        if act is StopSignalAct.ABORT:
            self._abort(name, before)
        elif act is StopSignalAct.DRAIN:
            self._drain_now(self.options.drain_deadline, name)
        elif act is StopSignalAct.CUT_SHORT:
            log.warning("second %s: stopping the sessions now, without waiting for them (another signal ends the "
                        "agent at once)", name)
            self.spawn(self.drain.stop_now, f"the worker was stopped before its sessions finished (a second {name})",
                       name)
        else:  # not serving: it never says ready (a create then was placed on an agent leaving)
            if act is StopSignalAct.LEAVE_UNSERVED:
                log.info("%s before this agent served: it leaves without registering as ready (another signal "
                         "ends it at once)", name)
            else:
                log.info("%s while cut off from the authority: it leaves without registering again", name)
            for scope in self._stop_scopes:
                scope.cancel()
            self._model_settled.set()  # no registration follows

    def _abort(self, name: str, leaving: State) -> NoReturn:
        """A stop signal while the pipeline loads (nothing to drain), or while the agent was already on its way out:
        it ends now, not once what is under way (a pipeline still loading, a dial, the service's close) returns;
        its child processes and their shared memory go with it, and its folder."""
        exit_now(self._exit_code(), f"a stop signal ({name}) while {leaving.value.replace('_', ' ')}",
                 self.sessions.close, log)

    @contextlib.contextmanager
    def _stoppable(self) -> Iterator[trio.CancelScope]:
        """A cancel scope a stop signal before serving cancels (at once, when one came already)."""
        with trio.CancelScope() as scope:
            if self.life.state in LEAVING:
                scope.cancel()
            self._stop_scopes.add(scope)
            try:
                yield scope
            finally:
                self._stop_scopes.discard(scope)

    async def _registrations(self) -> int:
        """Register, serve, and register again (a fresh id) after a loss, on the shared restart policy."""
        restarts = RestartTracker(REREGISTER_POLICY)
        patience = Patience()
        while True:
            ended = await self._one_registration()
            if ended.kind is End.REFUSED:
                return EXIT_REFUSED
            if self.life.state in LEAVING:  # drained, cut short, or stopped before it served
                return self._exit_code()
            if self.life.can(Event.CUT_OFF):
                self.life.apply(Event.CUT_OFF)  # it dials again under a fresh id
            if ended.kind is End.AUTHORITY_STOPPED:
                patience.reset()  # it registered: the waits after this stop are a fresh run
            elif ended.kind in (End.AUTHORITY_GONE, End.FENCED):
                patience.registered()  # as after a stop, but one that goes again and again is dialed ever slower
            if ended.kind in UNCOUNTED:
                # the authority proved it asks to wait (a flood fills its handshakes, or it is not ready for this
                # agent yet) or that it stops, or nothing answers at its address (it restarts): dial again soon,
                # not counted
                delay = patience.delay(ended, trio.current_time())
                # ended.why is the authority's own proven reason, cut (dial_ends.MAX_PROVEN_REASON): it repeats an
                # agent's text only echo()-ed
                if delay is None:
                    log.error("agent at %s: the authority %s (%s) for more than %.0f s; giving up",
                              self.options.authority, WAITED[ended.kind], ended.why, DIAL_DEADLINES[ended.kind])
                    # nothing there speaks the protocol: another agent given this address would fail the same way
                    return EXIT_REFUSED if ended.kind is End.NOT_AN_AUTHORITY else 1
                self.dial_log.waiting(ended, delay, trio.current_time())
                with self._stoppable(), trio.move_on_after(delay):
                    await trio.sleep_forever()
                continue
            patience.reset()
            with self._stoppable():
                pace = self.dial_log.unproven_restarts if ended.kind is End.UNPROVEN_REFUSAL else None
                if not await back_off(restarts, f"authority connection ended ({ended.why})",
                                      f"agent at {self.options.authority}", pace=pace):
                    return EXIT_REFUSED if ended.kind is End.UNPROVEN_REFUSAL else 1

    async def _one_registration(self) -> Ended:
        if self.life.state in LEAVING:  # a stop signal came as it waited to dial
            return Ended(End.STOPPED, "a stop signal came before the dial")
        worker_id = new_worker_id(self.options.node)
        # an agent that registered here before knows an authority is there: one that is silent has stalled
        shaken = await handshake(self.options, (self.scheme, self.host, self.port), self._tls, worker_id,
                                 self._stoppable, proven=self.worker_id is not None, unproven=self.dial_log.unproven)
        if not isinstance(shaken, Shaken):
            return shaken
        channel, welcome = shaken.channel, shaken.welcome
        self.clock.registered(shaken.sent_at)
        self.worker_id = worker_id
        self.worker.worker_id = worker_id  # runners join rooms as chunkline-<worker id>
        self.sessions.attach(welcome)
        log.info("registered as %s with %s%s", worker_id, self.options.authority,
                 self.dial_log.registered(trio.current_time()))
        outbox_send, outbox = trio.open_memory_channel[wire.Message](OUTBOX)
        self._outbox = outbox_send
        self._flushed = trio.Event()
        self._pump_scope = trio.CancelScope()
        channel.send_timeout = welcome.deadline  # an authority that takes no frame for that long is gone
        outcome: str | None = None  # the first end wins: the authority closes as the goodbye reaches it
        self._authority_goodbye = self._authority_gone = self._fenced_by_authority = None
        try:
            async with trio.open_nursery() as nursery:
                async def until(make: Callable[[], Awaitable[str]]) -> None:
                    nonlocal outcome
                    ended = await make()
                    outcome = outcome or ended
                    nursery.cancel_scope.cancel()

                transport_run = getattr(self.sessions.transport, "run", None)
                if transport_run is not None:  # LiveKit: its asyncio loop lives as long as this registration
                    await nursery.start(transport_run)
                nursery.start_soon(until, lambda: self._pump(channel, outbox))
                nursery.start_soon(until, lambda: self._read(channel))
                nursery.start_soon(until, lambda: self.clock.beat(welcome.heartbeat_interval, self.send,
                                                                  lambda: self.sessions.runners))
                nursery.start_soon(until, lambda: self.clock.fence(welcome.deadline))
                nursery.start_soon(until, self._until_drained)
                nursery.start_soon(until, self._until_worker_failed)
                nursery.start_soon(self.sessions.report_participants)
                if self.life.can(Event.SERVE):
                    self.life.apply(Event.SERVE)
                    self.send(self._ready)  # type: ignore[arg-type]
                else:  # a stop signal since the register went out: never ready, it leaves as a drained agent does
                    self.send(wire.Drain(self.options.drain_deadline))
                    self.drain.done.set()
        finally:
            self._outbox = None
            outcome = outcome or "connection lost"
            told = outcome  # what the agent says of the end; ``outcome`` alone decides which end it was
            if outcome != "drained":
                running = len(self.sessions.runners)
                await self.sessions.stop_all(f"worker fenced: {outcome}", hard=True)
                if running:
                    told += f"; worker {worker_id} stopped its {running} session(s)"
                if self.life.state in LEAVING:  # else the line that says what the agent does next names it
                    log.warning("worker %s: %s", worker_id, told)
            await channel.aclose()
        if outcome == "drained":
            return Ended(End.DRAINED, told)
        if outcome == self._authority_goodbye:
            return Ended(End.AUTHORITY_STOPPED, told)
        if outcome in (FENCED, self._fenced_by_authority):  # the authority's silence or verdict: not counted
            return Ended(End.FENCED, told)
        return Ended(End.AUTHORITY_GONE if outcome == self._authority_gone else End.LOST, told)

    # -- the connection --

    def send(self, message: wire.Message) -> None:
        if self._outbox is None:
            return
        try:
            self._outbox.send_nowait(message)
        except trio.WouldBlock:
            log.error("the authority does not read: closing the connection")
            self._outbox.close()
            self._pump_scope.cancel()  # the pump may be stuck in a large send: the connection ends now
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the connection is gone; its loss is being handled

    async def _pump(self, channel: wire.Channel, outbox: trio.MemoryReceiveChannel[wire.Message]) -> str:
        """Send the outbox in order; returns why the connection broke on this side (a send failed or took past
        its deadline, or the outbox overflowed), or "drained" once the goodbye went out (first: the authority closes
        the connection as it reads it, and the agent's exit status tells a drain that ran its course)."""
        try:
            with self._pump_scope:
                async with outbox:
                    async for message in outbox:
                        try:
                            await channel.send(message)
                        except wire.ConnectionClosed as exc:
                            return self._connection_lost(exc)
                        if isinstance(message, wire.Goodbye):  # it went out: the registration ended as asked
                            self.life.apply(Event.GOODBYE)
                            return "drained"
        finally:
            self._flushed.set()
        if self._pump_scope.cancelled_caught:
            return f"connection lost: the authority stopped reading ({OUTBOX} messages wait for it)"
        await trio.sleep_forever()  # flushed: the drain ends this registration

    async def _flush_and_close(self) -> None:
        """Close the outbox and wait (bounded) until what it holds was sent."""
        if self._outbox is not None:
            self._outbox.close()
        with trio.move_on_after(2.0):
            await self._flushed.wait()

    async def _read(self, channel: wire.Channel) -> str:
        while True:
            try:
                message = await channel.receive()
            except wire.ConnectionClosed as exc:
                return self._connection_lost(exc)
            except wire.WireError as exc:
                return f"protocol error: {exc}"
            if isinstance(message, wire.HeartbeatAck):
                self.clock.acknowledged(message.seq)
            elif isinstance(message, wire.Start):
                self.sessions.start(message, refusal=start_refusal(self.life.state))
            elif isinstance(message, wire.Stop):
                self.sessions.stop(message)
            elif isinstance(message, wire.CheckOptions):
                assert self._nursery is not None
                self._nursery.start_soon(self._check_options, message)
            elif isinstance(message, wire.Drain):
                self.begin_drain(message.deadline)
            elif isinstance(message, wire.Refused):  # tagged: the authority drops this worker, and says why
                refused = f"refused: {cut(message.reason, MAX_PROVEN_REASON)}"
                if message.transient:  # it lost this worker on the heartbeat clock (a fence), no fault of the agent's
                    self._fenced_by_authority = refused
                return refused
            elif isinstance(message, wire.Goodbye):  # the authority stops (tagged: nobody else can say it)
                self._authority_goodbye = f"the authority said goodbye: {cut(message.reason, MAX_PROVEN_REASON)}"
                return self._authority_goodbye

    def _connection_lost(self, exc: wire.ConnectionClosed) -> str:
        """Why the connection ended, as this registration's outcome; one that closed or was reset with no word from the
        authority (:func:`~server.cluster.dial_ends.vanished`) ends it as the authority gone."""
        lost = f"connection lost: {exc}"
        if vanished(exc) and self._authority_gone is None:  # the first, as the outcome is (the pump's and the reader's)
            self._authority_gone = lost
        return lost

    async def _check_options(self, message: wire.CheckOptions) -> None:
        """The pipeline's word on a create's options and image, for the authority (which bounds its own wait too)."""
        refused = error = image_refused = None
        try:
            with trio.fail_after(CHECK_OPTIONS_TIMEOUT):
                await self.worker.check_options(message.options, message.image_size)
        except OptionsRefused as exc:
            refused = exc.reason
        except SessionImageRefused as exc:
            image_refused = exc.reason
        except Exception as exc:
            log.warning("checking a session's options failed: %r", exc)
            error = "no answer in time" if isinstance(exc, trio.TooSlowError) else public_reason(exc)
        self.send(wire.OptionsChecked(message.check_id, refused, error, image_refused))

    def _model_ready(self, worker: ModelWorker, capacity: int, plan: CapacityPlan) -> None:
        self.life.apply(Event.LOADED)  # from here a stop signal lets it leave in order (states.agent)
        inputs = worker.inputs_taken or frozenset()
        self._ready = wire.Ready(capacity, worker.kind or "unknown", plan.to_dict(), dict(worker.startup_check or {}),
                                 worker.settings_taken, "prompt" in inputs, "image" in inputs, self.options.worker_mode)
        self._model_settled.set()

    def _model_failed(self, worker: ModelWorker, reason: str, *, permanent: bool = False) -> None:
        self._model_failure = reason
        self._model_refused = permanent
        if self.life.can(Event.WORKER_FAILED):  # loaded, then failed: nothing left to run sessions on
            if self.life.apply(Event.WORKER_FAILED) in WORKER_GONE:
                log.error("the model worker failed: %s; this agent leaves (exit 1)", reason)
                self._worker_failed.set()
                for scope in self._stop_scopes:  # a dial, or the wait before the next, ends now
                    scope.cancel()
        self._model_settled.set()

    async def _until_worker_failed(self) -> str:
        """The model worker failed: no more sessions here, its runners end (bounded) and say why, then the agent."""
        await self._worker_failed.wait()
        self.send(wire.Drain(RUNNER_STOP_GRACE))  # no session is placed here meanwhile (the Start would be refused)
        with trio.move_on_after(RUNNER_STOP_GRACE):
            await self.sessions.until_empty()
        self.send(wire.Failed(f"its model worker failed: {self._model_failure}"))
        await self._flush_and_close()
        return f"the model worker failed: {self._model_failure}"

    # -- drain --

    def begin_drain(self, deadline: float) -> None:
        """The authority's drain (a signal's comes through :meth:`_stop_signal`)."""
        if not self.life.can(Event.DRAIN):
            return
        before = self.life.state
        if self.life.apply(Event.DRAIN) is not before:
            self._drain_now(deadline, f"the authority (POST /v1/service/workers/{self.worker_id}/drain)")

    def _drain_now(self, deadline: float, asked_by: str) -> None:
        """A second signal then stops the sessions at once, before the goodbye (:meth:`AgentDrain.stop_now`): left to
        the goodbye, they failed as "worker lost: left after draining", and the agent exited 0 as if it had drained."""
        self.send(wire.Drain(deadline))
        self.spawn(self.drain.run, asked_by, deadline)

    async def _until_drained(self) -> str:
        await self.drain.done.wait()
        self.send(wire.Goodbye("drained"))
        await self._flush_and_close()
        return "drained"
