"""Exhaustive breadth-first exploration of the books' small configurations.

``python -m states.explore`` walks every reachable state of each configuration,
checks the invariants in each, prints one line per configuration (states
explored, transitions taken, violations found) and exits non-zero on any
violation. ``--small`` runs reduced bounds (what the test suite uses).

Each configuration lives next to the rules it exercises
(``explore_admission``, ``explore_lease``); this module only runs them.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Generic, TypeVar

import attrs

World = TypeVar("World")

__all__ = ["Configuration", "Report", "explore", "main"]


@attrs.frozen
class Report:
    name: str
    states: int
    transitions: int
    violations: tuple[str, ...]
    seconds: float

    def line(self) -> str:
        return (
            f"{self.name}: {self.states} states, {self.transitions} transitions, "
            f"{len(self.violations)} violations ({self.seconds:.1f}s)"
        )


@attrs.frozen
class Configuration(Generic[World]):
    """A small world to explore exhaustively.

    ``initial`` builds the start world; ``successors(world)`` yields
    ``(label, next_world)`` for every enabled event (it must not mutate
    ``world``); ``key(world)`` is a hashable canonical form (apply symmetry
    here); ``check(world)`` returns the invariant violations in that world.
    """

    name: str
    initial: Callable[[], World]
    successors: Callable[[World], Iterable[tuple[str, World]]]
    key: Callable[[World], Hashable]
    check: Callable[[World], Sequence[str]]


def explore(config: Configuration, *, max_violations: int = 5) -> Report:
    """Breadth-first search over ``config``; stops early after ``max_violations``."""
    started = time.perf_counter()
    start = config.initial()
    # parent links let a violation be reported with the path that reached it
    parents: dict[Hashable, tuple[Hashable | None, str]] = {config.key(start): (None, "")}
    frontier = deque([start])
    transitions = 0
    violations: list[str] = []

    def path_to(key: Hashable) -> str:
        labels = []
        while key is not None:
            key, label = parents[key]
            if label:
                labels.append(label)
        return " -> ".join(reversed(labels)) or "<initial>"

    def record(world_key: Hashable, problems: Sequence[str]) -> None:
        for problem in problems:
            violations.append(f"{problem} after {path_to(world_key)}")

    record(config.key(start), config.check(start))
    while frontier and len(violations) < max_violations:
        world = frontier.popleft()
        world_key = config.key(world)
        for label, nxt in config.successors(world):
            transitions += 1
            nxt_key = config.key(nxt)
            if nxt_key in parents:
                continue
            parents[nxt_key] = (world_key, label)
            record(nxt_key, config.check(nxt))
            frontier.append(nxt)
    return Report(
        name=config.name,
        states=len(parents),
        transitions=transitions,
        violations=tuple(violations),
        seconds=time.perf_counter() - started,
    )


def configurations(small: bool) -> list[Configuration]:
    from . import (
        explore_admission,
        explore_lease,
        explore_liveness,
        explore_room_follow,
        explore_room_presence,
        explore_supervision,
    )

    return [
        *explore_admission.configurations(small),
        *explore_lease.configurations(small),
        *explore_supervision.configurations(small),
        *explore_room_presence.configurations(small),
        *explore_room_follow.configurations(small),
        *explore_liveness.configurations(small),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m states.explore", description=__doc__)
    parser.add_argument("--small", action="store_true", help="reduced bounds (for the test suite)")
    args = parser.parse_args(argv)
    total_states = 0
    failed = False
    for config in configurations(args.small):
        report = explore(config)
        total_states += report.states
        print(report.line())
        for violation in report.violations:
            print(f"  VIOLATION: {violation}")
        failed = failed or bool(report.violations)
    print(f"total: {total_states} states, {'FAILED' if failed else 'no violations'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
