"""The wire's field converters: a decoded JSON value to a message field's type, or a ``TypeError`` saying
what is wrong with it (:func:`server.cluster.wire.decode` adds the message and the field's name)."""

from __future__ import annotations

import math
from typing import Any

from ..reasons import echo

__all__ = ["MAX_CAPACITY", "kind_of", "text", "opt_text", "flag", "number", "seconds", "integer", "integers",
           "texts", "opt_texts", "obj", "opt_obj", "capacity", "plan", "positive", "settings_taken",
           "SESSION_SETTINGS"]

#: the most sessions one agent may report it can retain (the CLI's --max-sessions allows 64)
MAX_CAPACITY = 4096


def kind_of(value: object) -> str:
    """A JSON value's kind, for an error message."""
    return {type(None): "null", dict: "object", list: "list", bool: "bool"}.get(type(value), type(value).__name__)


def text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected str, got {kind_of(value)}")
    return value


def opt_text(value: object) -> str | None:
    return None if value is None else text(value)


def flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected bool, got {kind_of(value)}")
    return value


def number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {kind_of(value)}")
    return float(value)


def seconds(value: object) -> float:
    count = number(value)
    if not 0 < count < math.inf:
        raise TypeError(f"must be a number of seconds > 0, got {count!r}")
    return count


def positive(value: object) -> float:
    count = number(value)
    if not 0 < count < math.inf:
        raise TypeError(f"must be a finite number > 0, got {count!r}")
    return count


def integer(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected int, got {kind_of(value)}")
    return value


def _items(value: object, item: Any, name: str) -> tuple[Any, ...]:
    """A list converted item by item; an error names the item (``[2]: expected int, got str``)."""
    if not isinstance(value, list | tuple):
        raise TypeError(f"expected a list of {name}, got {kind_of(value)}")
    converted = []
    for index, one in enumerate(value):
        try:
            converted.append(item(one))
        except TypeError as exc:
            raise TypeError(f"[{index}]: {exc}") from None
    return tuple(converted)


def integers(value: object) -> tuple[int, ...]:
    return _items(value, integer, "int")


def texts(value: object) -> tuple[str, ...]:
    return _items(value, text, "str")


def opt_texts(value: object) -> tuple[str, ...] | None:
    return None if value is None else texts(value)


def obj(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {kind_of(value)}")
    return value


def opt_obj(value: object) -> dict[str, Any] | None:
    return None if value is None else obj(value)


def capacity(value: object) -> int:
    count = integer(value)
    if not 1 <= count <= MAX_CAPACITY:
        raise TypeError(f"must be 1-{MAX_CAPACITY}, got {echo(count)}")  # JSON allows 4,300 digits
    return count


_PLAN_FIELDS = {"computed_capacity": True, "effective_capacity": False, "configured_limit": True}


def plan(value: object) -> dict[str, Any]:
    """A capacity plan as the agent's ``CapacityPlan.to_dict`` makes it: its counts are integers."""
    facts = obj(value)
    missing = [name for name in (*_PLAN_FIELDS, "limiting_device") if name not in facts]
    if missing:
        raise TypeError(f"lacks {', '.join(missing)}")
    for name, optional in _PLAN_FIELDS.items():
        count = facts.get(name)
        if not (count is None and optional) and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise TypeError(f".{name}: must be an integer >= 0{' or null' if optional else ''}, got {echo(count)}")
    if not isinstance(facts.get("limiting_device"), str | None):
        raise TypeError(f".limiting_device: expected str or null, got {kind_of(facts.get('limiting_device'))}")
    return facts


#: the offered settings a session runs with, which metadata shows per worker (``worker_settings``): each a finite
#: number > 0 when taken
SESSION_SETTINGS = ("control_idle_timeout", "fps")


def settings_taken(value: object) -> dict[str, Any] | None:
    """The offered settings an agent's pipeline took, with their values (None: not known); those the authority
    shows (:data:`SESSION_SETTINGS`) must be numbers > 0."""
    if value is None:
        return None
    taken = dict(obj(value))
    for name in SESSION_SETTINGS:
        if name in taken:
            try:
                taken[name] = positive(taken[name])
            except TypeError as exc:
                raise TypeError(f".{name}: {exc}") from None
    return taken
