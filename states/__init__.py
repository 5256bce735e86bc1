"""The formal state model: every lifecycle as a table, and the pure books that decide who moves.

Pure and synchronous: standard library and attrs only, no I/O, no clocks (``now`` is
always an argument).
"""

from .machine import IllegalTransition, StateMachine

__all__ = ["IllegalTransition", "StateMachine"]
