"""The one mechanism every lifecycle uses: look the (state, event) pair up in a table.

Each lifecycle module owns a ``TRANSITIONS`` dict literal and a subclass of
:class:`StateMachine` naming it. Nothing else in chunkline assigns a state: code
that wants a state to change applies an event, and an event the table does not
list for the current state raises :class:`IllegalTransition` and changes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import ClassVar, Generic, TypeVar

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)

__all__ = ["IllegalTransition", "StateMachine", "TableEnum"]


class TableEnum(enum.Enum):
    """The base of every lifecycle's states and events: hashed by identity.

    Members are singletons, so identity is their equality; ``enum.Enum``'s own hash is
    Python code, and the scheduler asks set membership of a session's state on every
    admission and completion.
    """

    __hash__ = object.__hash__


class IllegalTransition(Exception):
    """An event arrived in a state whose table row does not list it.

    The machine's state is unchanged; the caller decides whether that is a bug
    (usually) or a race it should have ruled out first with ``can``.
    """

    def __init__(self, machine: str, state: enum.Enum, event: enum.Enum) -> None:
        self.machine = machine
        self.state = state
        self.event = event
        super().__init__(
            f"{machine}: event {event.name} is not allowed in state {state.name}"
        )


class StateMachine(Generic[S, E]):
    """A single-owner state holder driven only through its table.

    Subclasses set ``NAME``, ``TABLE`` and ``INITIAL`` (and optionally
    ``TERMINAL``); instances may be created in any state so that tests and
    books can resume from a known point.
    """

    NAME: ClassVar[str]
    TABLE: ClassVar[Mapping]
    INITIAL: ClassVar[enum.Enum]
    TERMINAL: ClassVar[frozenset] = frozenset()

    __slots__ = ("_state",)

    def __init__(self, state: S | None = None) -> None:
        self._state: S = self.INITIAL if state is None else state  # type: ignore[assignment]

    @property
    def state(self) -> S:
        return self._state

    @property
    def is_terminal(self) -> bool:
        return self._state in self.TERMINAL

    def can(self, event: E) -> bool:
        """Whether ``event`` is allowed now (a pure query)."""
        return (self._state, event) in self.TABLE

    def apply(self, event: E) -> S:
        """Move to the state the table names, or raise and stay put."""
        try:
            new_state = self.TABLE[(self._state, event)]
        except KeyError:
            raise IllegalTransition(self.NAME, self._state, event) from None
        self._state = new_state
        return new_state

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._state.name}>"
