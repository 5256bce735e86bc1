"""The wire's field converters: a decoded JSON value to a message field's type, or a ``TypeError`` saying
what is wrong with it (:func:`server.cluster.wire.decode` adds the message and the field's name)."""

from __future__ import annotations

import json
import math
from typing import Any

from ..reasons import echo
from ..tokens import MAX_IDENTITY_LENGTH

__all__ = ["MAX_CAPACITY", "kind_of", "text", "opt_text", "flag", "number", "seconds", "integer",
           "texts", "obj", "opt_obj", "capacity", "plan", "positive", "settings_taken", "drain_seconds", "MAX_DRAIN_SECONDS",
           "SESSION_SETTINGS", "MAX_PARTICIPANTS", "MAX_REPORT_CHARS", "MAX_LABEL", "MAX_NODE", "MAX_DEVICES",
           "label", "opt_label", "node_name", "device_indexes", "process_id", "identities", "report", "opt_image_size"]

#: the most sessions one agent may report it can retain (the CLI's --max-sessions allows 64)
MAX_CAPACITY = 4096
#: the most participants an agent may report in one session's room: a local room holds 64 sockets, and a session's
#: tokens name its controller and at most 32 viewers (each identity at most ``MAX_IDENTITY_LENGTH`` characters)
MAX_PARTICIPANTS = 64
#: characters of JSON in one free-form report an agent sends (its capacity plan, its startup check, the settings its
#: pipeline took): a real one is a few KiB (a plan names each device and its roles)
MAX_REPORT_CHARS = 64 * 1024
#: characters of a short name an agent sends (a service kind, a launcher, a launcher's slot)
MAX_LABEL = 64
#: characters of a node name (a host name: at most 253 as a fully qualified DNS name)
MAX_NODE = 255
#: device indexes one agent may report (a node with eight GPUs of seven MIG instances each has 56)
MAX_DEVICES = 256
#: seconds a drain may give live sessions, either way on the wire, and what a drain through the API
#: (``server.app.MAX_DRAIN_DEADLINE`` is this) and ``chunkline worker --drain-deadline`` take at most; taken unbounded,
#: an agent's own drain held its worker draining, heartbeating, for as long as it liked
MAX_DRAIN_SECONDS = 3600.0


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


def drain_seconds(value: object) -> float:
    """A drain's deadline: seconds > 0, at most :data:`MAX_DRAIN_SECONDS`."""
    count = seconds(value)
    if count > MAX_DRAIN_SECONDS:
        raise TypeError(f"must be at most {MAX_DRAIN_SECONDS:g} seconds, got {count!r}")
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


def _items(value: object, item: Any, name: str, *, most: int | None = None) -> tuple[Any, ...]:
    """A list converted item by item, of at most ``most`` items (counted before any is read); an error names the
    item (``[2]: expected int, got str``)."""
    if not isinstance(value, list | tuple):
        raise TypeError(f"expected a list of {name}, got {kind_of(value)}")
    if most is not None and len(value) > most:
        raise TypeError(f"{len(value)} items; at most {most}")
    converted = []
    for index, one in enumerate(value):
        try:
            converted.append(item(one))
        except TypeError as exc:
            raise TypeError(f"[{index}]: {exc}") from None
    return tuple(converted)


def texts(value: object) -> tuple[str, ...]:
    return _items(value, text, "str")


def _bounded(value: str, limit: int) -> str:
    if len(value) > limit:
        raise TypeError(f"{len(value)} characters; at most {limit}")
    return value


def label(value: object) -> str:
    """A short name (a service kind, a launcher, a slot): at most :data:`MAX_LABEL` characters."""
    return _bounded(text(value), MAX_LABEL)


def opt_label(value: object) -> str | None:
    return None if value is None else label(value)


def node_name(value: object) -> str:
    return _bounded(text(value), MAX_NODE)


def _index(value: object) -> int:
    count = integer(value)
    if not 0 <= count < 2**31:
        raise TypeError(f"must be 0-{2**31 - 1}, got {echo(count)}")  # JSON allows 4,300 digits
    return count


def device_indexes(value: object) -> tuple[int, ...]:
    """Device indexes: at most :data:`MAX_DEVICES` of them, each 0-2**31-1."""
    return _items(value, _index, "int", most=MAX_DEVICES)


def process_id(value: object) -> int:
    """A process id: 0-2**31-1 (Linux allows at most 2**22)."""
    return _index(value)


def opt_image_size(value: object) -> tuple[int, int] | None:
    """An image's size, ``[width, height]`` (each 1-2**31-1), or None: no image."""
    if value is None:
        return None
    size = _items(value, _index, "int", most=2)
    if len(size) != 2 or 0 in size:
        raise TypeError(f"must be [width, height], each 1-{2**31 - 1}, got {echo(list(size))}")
    return size[0], size[1]


def identities(value: object) -> tuple[str, ...]:
    """Participant identities in a room: at most :data:`MAX_PARTICIPANTS`, each at most ``MAX_IDENTITY_LENGTH``
    characters (what the authority's tokens name; the count checked before any is read)."""
    return _items(value, lambda one: _bounded(text(one), MAX_IDENTITY_LENGTH), "str", most=MAX_PARTICIPANTS)


def obj(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {kind_of(value)}")
    return value


def opt_obj(value: object) -> dict[str, Any] | None:
    return None if value is None else obj(value)


def report(value: object) -> dict[str, Any]:
    """A free-form object an agent reports and the authority shows: at most :data:`MAX_REPORT_CHARS` of JSON."""
    facts = obj(value)
    size = len(json.dumps(facts, separators=(",", ":")))
    if size > MAX_REPORT_CHARS:
        raise TypeError(f"{size} characters of JSON; at most {MAX_REPORT_CHARS}")
    return facts


def capacity(value: object) -> int:
    count = integer(value)
    if not 1 <= count <= MAX_CAPACITY:
        raise TypeError(f"must be 1-{MAX_CAPACITY}, got {echo(count)}")  # JSON allows 4,300 digits
    return count


_PLAN_FIELDS = {"computed_capacity": True, "effective_capacity": False, "configured_limit": True}


def plan(value: object) -> dict[str, Any]:
    """A capacity plan as the agent's ``CapacityPlan.to_dict`` makes it: its counts are integers."""
    facts = report(value)
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
    taken = dict(report(value))
    for name in SESSION_SETTINGS:
        if name in taken:
            try:
                taken[name] = positive(taken[name])
            except TypeError as exc:
                raise TypeError(f".{name}: {exc}") from None
    return taken
