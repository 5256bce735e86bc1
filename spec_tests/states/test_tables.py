"""Every lifecycle table, checked exhaustively against its machine and as a graph.

For each lifecycle module: every (state, event) pair of the full
product either follows the table or raises ``IllegalTransition`` and changes
nothing; ``can`` agrees with the table; every state is reachable from INITIAL;
terminal states are never left; every live state can still end; every event is
used.
"""

from __future__ import annotations

import itertools
from collections import deque
from types import ModuleType

import pytest

import states
from states import (
    agent,
    child_process,
    lease,
    liveness,
    pipeline_session,
    process_group,
    restart_policy,
    room_follow,
    room_presence,
    service_child,
    stage_actor,
    stream_session,
    worker,
)
from states.machine import StateMachine

MODULES: dict[ModuleType, type[StateMachine]] = {
    stream_session: stream_session.StreamSessionMachine,
    lease: lease.LeaseMachine,
    pipeline_session: pipeline_session.PipelineSessionMachine,
    stage_actor: stage_actor.StageActorMachine,
    worker: worker.WorkerMachine,
    child_process: child_process.ChildProcessMachine,
    process_group: process_group.ProcessGroupMachine,
    service_child: service_child.ServiceChildMachine,
    restart_policy: restart_policy.RestartMachine,
    room_presence: room_presence.RoomPresenceMachine,
    room_follow: room_follow.RoomFollowMachine,
    liveness: liveness.LivenessMachine,
    agent: agent.AgentMachine,
}

# Self-loops on a terminal state that a module's docstring documents on purpose:
# a FAILED worker still has its retained sessions released through it one by
# one, and those removal events keep it FAILED. Anything else leaving (or
# looping on) a terminal state fails ``test_terminal_states_have_no_outgoing_edges``.
TERMINAL_SELF_LOOPS: dict[ModuleType, frozenset] = {
    worker: frozenset(
        {
            (worker.State.FAILED, worker.Event.SESSION_REMOVED),
            (worker.State.FAILED, worker.Event.LAST_SESSION_REMOVED),
        }
    ),
}


def _short(module: ModuleType) -> str:
    return module.__name__.rpartition(".")[2]


def _pairs():
    for module in MODULES:
        for state, event in itertools.product(module.State, module.Event):
            yield pytest.param(module, state, event, id=f"{_short(module)}-{state.name}-{event.name}")


module_params = pytest.mark.parametrize("module", list(MODULES), ids=_short)


def _successors(module: ModuleType) -> dict:
    graph: dict = {state: set() for state in module.State}
    for (source, _event), target in module.TRANSITIONS.items():
        graph[source].add(target)
    return graph


def _closure(graph: dict, start) -> set:
    seen = {start}
    queue = deque([start])
    while queue:
        for nxt in graph[queue.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


@module_params
def test_machine_is_wired_to_its_module_table(module: ModuleType) -> None:
    machine = MODULES[module]
    assert machine.TABLE is module.TRANSITIONS
    assert machine.TERMINAL == module.TERMINAL
    assert isinstance(machine.INITIAL, module.State)
    assert machine.NAME
    assert set(module.TERMINAL) <= set(module.State)
    for (source, event), target in module.TRANSITIONS.items():
        assert isinstance(source, module.State), (source, event)
        assert isinstance(event, module.Event), (source, event)
        assert isinstance(target, module.State), (source, event)
    assert machine().state is machine.INITIAL


@pytest.mark.parametrize(("module", "state", "event"), list(_pairs()))
def test_every_pair_follows_the_table(module: ModuleType, state, event) -> None:
    machine_type = MODULES[module]
    machine = machine_type(state)
    key = (state, event)
    assert machine.can(event) is (key in module.TRANSITIONS)
    if key in module.TRANSITIONS:
        target = module.TRANSITIONS[key]
        assert machine.apply(event) is target
        assert machine.state is target
        assert machine.is_terminal is (target in module.TERMINAL)
    else:
        with pytest.raises(states.IllegalTransition) as caught:
            machine.apply(event)
        error = caught.value
        assert error.machine == machine_type.NAME
        assert error.state is state
        assert error.event is event
        message = str(error)
        assert machine_type.NAME in message
        assert state.name in message
        assert event.name in message
        assert machine.state is state, "an illegal event must not change the state"


@module_params
def test_every_state_is_reachable_from_initial(module: ModuleType) -> None:
    reachable = _closure(_successors(module), MODULES[module].INITIAL)
    unreachable = [state.name for state in module.State if state not in reachable]
    assert not unreachable, f"{_short(module)}: unreachable from INITIAL: {unreachable}"


@module_params
def test_terminal_states_are_never_left(module: ModuleType) -> None:
    leaving = [
        (source.name, event.name, target.name)
        for (source, event), target in module.TRANSITIONS.items()
        if source in module.TERMINAL and target is not source
    ]
    assert not leaving, f"{_short(module)}: transitions out of terminal states: {leaving}"


@module_params
def test_terminal_states_have_no_outgoing_edges(module: ModuleType) -> None:
    allowed = TERMINAL_SELF_LOOPS.get(module, frozenset())
    outgoing = [
        (source.name, event.name)
        for (source, event) in module.TRANSITIONS
        if source in module.TERMINAL and (source, event) not in allowed
    ]
    assert not outgoing, f"{_short(module)}: outgoing edges on terminal states: {outgoing}"
    # The allowance is not stale: each listed loop is in the table, on a terminal state.
    for source, event in allowed:
        assert source in module.TERMINAL
        assert module.TRANSITIONS.get((source, event)) is source


@module_params
def test_every_live_state_can_reach_a_terminal_state(module: ModuleType) -> None:
    graph = _successors(module)
    stuck = [
        state.name
        for state in module.State
        if state not in module.TERMINAL and not (_closure(graph, state) & module.TERMINAL)
    ]
    assert not stuck, f"{_short(module)}: states that can never end: {stuck}"


@module_params
def test_has_a_terminal_state(module: ModuleType) -> None:
    assert module.TERMINAL, f"{_short(module)}: no terminal state"
    assert MODULES[module].INITIAL not in module.TERMINAL


@module_params
def test_every_event_is_used(module: ModuleType) -> None:
    used = {event for (_state, event) in module.TRANSITIONS}
    unused = [event.name for event in module.Event if event not in used]
    assert not unused, f"{_short(module)}: events no transition uses: {unused}"


@module_params
def test_can_is_a_pure_query(module: ModuleType) -> None:
    machine_type = MODULES[module]
    for state in module.State:
        machine = machine_type(state)
        allowed = {event for event in module.Event if machine.can(event)}
        assert allowed == {event for (source, event) in module.TRANSITIONS if source is state}
        assert machine.state is state


def test_a_stop_signal_has_an_act_for_every_state_it_leads_to() -> None:
    """The agent looks up what a stop signal makes it do by the state the signal moved it to: every such state
    has its act (a row added to the table without one would end the agent in a KeyError at the signal)."""
    led_to = {target for (_source, event), target in agent.TRANSITIONS.items() if event is agent.Event.STOP_SIGNAL}
    assert led_to == set(agent.ON_STOP_SIGNAL)
