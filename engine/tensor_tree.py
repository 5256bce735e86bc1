"""Nested structures of tensors (or refs) as the tensor channel walks them.

A *tree* is any nesting of dicts (and dict subclasses), lists, tuples and named
tuples; every other object is a leaf. The helpers rebuild containers with their
own type and leave non-matching leaves untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["leaves_of", "map_leaves", "unique_tensors"]


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
