"""Nested structures of tensors (or refs) as the tensor channel walks them.

A *tree* is any nesting of dicts (and dict subclasses), lists, tuples and named
tuples; every other object is a leaf. The helpers rebuild containers with their
own type and leave non-matching leaves untouched.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

__all__ = ["hidden_tensor_holder", "leaves_of", "map_leaves", "unique_tensors"]

#: how deep :func:`hidden_tensor_holder` looks into a leaf for a tensor
HIDDEN_DEPTH = 8


def map_leaves(tree: Any, fn: Callable[[Any], Any], leaf_type: type | tuple[type, ...]) -> Any:
    """``tree`` with every ``leaf_type`` leaf replaced by ``fn(leaf)`` (containers rebuilt)."""
    if isinstance(tree, leaf_type):
        return fn(tree)
    if isinstance(tree, dict):
        items = [(k, map_leaves(v, fn, leaf_type)) for k, v in tree.items()]
        return dict(items) if type(tree) is dict else type(tree)(items)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(map_leaves(v, fn, leaf_type) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_leaves(v, fn, leaf_type) for v in tree)
    return tree


def leaves_of(tree: Any, leaf_type: type | tuple[type, ...]) -> list[Any]:
    """Every ``leaf_type`` leaf of ``tree`` in tree order (duplicates included)."""
    out: list[Any] = []
    _walk(tree, leaf_type, out.append)
    return out


def unique_tensors(tree: Any) -> tuple[list[torch.Tensor], dict[int, int]]:
    """The distinct tensor objects of ``tree`` in first-seen order, and ``id(tensor) -> index``."""
    leaves: list[torch.Tensor] = []
    seen: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        if id(t) not in seen:
            seen[id(t)] = len(leaves)
            leaves.append(t)

    _walk(tree, torch.Tensor, add)
    return leaves, seen


def _walk(tree: Any, leaf_type: type | tuple[type, ...], visit: Callable[[Any], None]) -> None:
    if isinstance(tree, leaf_type):
        visit(tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            _walk(v, leaf_type, visit)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _walk(v, leaf_type, visit)


def hidden_tensor_holder(tree: Any) -> str | None:
    """The type of the first leaf of ``tree`` that holds a tensor the walk does not reach (a set, a deque, a mapping
    that is no dict, a dataclass or attrs instance), or None: a channel sends only the tensors it reaches, and the
    rest travelled whole with the refs, in the scheduler's hands."""
    if isinstance(tree, (dict, list, tuple)):  # the containers the walk enters
        for value in tree.values() if isinstance(tree, dict) else tree:
            if (holder := hidden_tensor_holder(value)) is not None:
                return holder
        return None
    return type(tree).__name__ if not isinstance(tree, torch.Tensor) and _holds_tensor(tree, 0) else None


def _holds_tensor(value: Any, depth: int) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth >= HIDDEN_DEPTH or isinstance(value, (str, bytes, bytearray, int, float, type)):
        return False
    if isinstance(value, Mapping):
        return any(_holds_tensor(k, depth + 1) or _holds_tensor(v, depth + 1) for k, v in value.items())
    if isinstance(value, (set, frozenset, deque, list, tuple)):
        return any(_holds_tensor(v, depth + 1) for v in value)
    if dataclasses.is_dataclass(value):
        return any(_holds_tensor(getattr(value, f.name, None), depth + 1) for f in dataclasses.fields(value))
    if attrs.has(type(value)):
        return any(_holds_tensor(getattr(value, f.name, None), depth + 1) for f in attrs.fields(type(value)))
    return False
