"""Parsing one setting value: text (from a flag or an environment variable) or a value in, checked value out.

Every failure is a :class:`SettingsError` naming the option (its CLI flag) and the bad value.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ENV_PREFIX",
    "GpuMap",
    "MAX_SECRET_FILE_BYTES",
    "SettingsError",
    "bad_value",
    "blank_to_none",
    "env_var",
    "option_for",
    "parse_bool",
    "parse_choice",
    "parse_cors_origins",
    "parse_float",
    "parse_gpu_map",
    "parse_int",
    "read_secret_file",
]

ENV_PREFIX = "CHUNKLINE_"
#: the most a secret's file (``--cluster-token-file``) may hold: a token is a line, not a file's worth
MAX_SECRET_FILE_BYTES = 4096
GpuMap = tuple[tuple[int, ...], ...]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_ORIGIN = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/\s?#]+$")


class SettingsError(ValueError):
    """A setting has a bad value. ``option`` is the flag to fix (``"--queue-size"``, ``"PIPE"``)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


class ListenError(SettingsError):
    """An address the server cannot listen on (a port in use, an address this host does not have)."""

    @classmethod
    def of(cls, options: str, host: str, port: int, exc: OSError) -> ListenError:
        return cls(options, f"{options}: cannot listen on {host}:{port}: {exc.strerror or exc}")


def option_for(field_name: str) -> str:
    """The command-line flag of a field: ``queue_size`` -> ``--queue-size`` (``pipeline`` -> ``PIPE``)."""
    if field_name == "pipeline":
        return "PIPE"
    return "--" + field_name.replace("_", "-")


def env_var(field_name: str) -> str:
    """The environment variable of a field: ``queue_size`` -> ``CHUNKLINE_QUEUE_SIZE``."""
    return ENV_PREFIX + field_name.upper()


# --- parsers: text or value in, checked value out -----------------------------------------------------------


def bad_value(option: str, expected: str, value: Any) -> SettingsError:
    """The error for ``value`` where ``option`` expects ``expected`` (raise it)."""
    return SettingsError(option, f"{option} must be {expected}, got {value!r}")


def parse_int(option: str, value: Any, lo: int, hi: int | None) -> int:
    expected = f"an integer between {lo} and {hi}" if hi is not None else f"an integer >= {lo}"
    if isinstance(value, bool):
        raise bad_value(option, expected, value)
    if isinstance(value, str):
        try:
            parsed = int(value.strip())
        except ValueError:
            raise bad_value(option, expected, value) from None
    elif isinstance(value, int):
        parsed = value
    else:
        raise bad_value(option, expected, value)
    if parsed < lo or (hi is not None and parsed > hi):
        raise bad_value(option, expected, value)
    return parsed


def _bound(number: float) -> str:
    """A bound as one would type it: 31536000, not ``:g``'s 3.1536e+07."""
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


def parse_float(option: str, value: Any, lo: float, hi: float | None = None, *, lo_open: bool = False) -> float:
    if lo_open:
        expected = "a number of seconds > 0" if lo == 0 else f"a number > {_bound(lo)}"
        expected += "" if hi is None else f", at most {_bound(hi)}"
    elif hi is not None:
        expected = f"a number between {_bound(lo)} and {_bound(hi)}"
    else:
        expected = f"a number >= {_bound(lo)}"
    if isinstance(value, bool):
        raise bad_value(option, expected, value)
    if isinstance(value, str):
        try:
            parsed = float(value.strip())
        except ValueError:
            raise bad_value(option, expected, value) from None
    elif isinstance(value, (int, float)):
        parsed = float(value)
    else:
        raise bad_value(option, expected, value)
    if not math.isfinite(parsed) or parsed < lo or (lo_open and parsed == lo) or (hi is not None and parsed > hi):
        raise bad_value(option, expected, value)
    return parsed


def parse_choice(option: str, value: Any, choices: Sequence[str]) -> str:
    expected = " or ".join(repr(c) for c in choices)
    if not isinstance(value, str) or value.strip().lower() not in choices:
        raise bad_value(option, expected, value)
    return value.strip().lower()


def parse_bool(option: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise bad_value(option, "true or false (1/0, true/false, yes/no, on/off)", value)


def blank_to_none(value: Any) -> Any:
    """Blank text means "not set"."""
    return None if isinstance(value, str) and not value.strip() else value


def parse_gpu_map(value: Any, option: str = "--worker-gpu-map") -> GpuMap | None:
    """``"0,1;2,3"`` -> ``((0, 1), (2, 3))``: ``;`` separates workers, ``,`` the GPUs of one worker.

    Blank text or None means no map. A sequence of sequences of ints is accepted as is (checked). Every group
    needs at least one GPU id (a non-negative integer); a GPU id may appear in only one group.
    """
    value = blank_to_none(value)
    if value is None:
        return None
    expected = "GPU groups like '0,1;2,3' (';' between workers, ',' between GPU ids)"
    if isinstance(value, str):
        raw_groups: list[list[Any]] = [part.split(",") for part in value.strip().split(";")]
    elif isinstance(value, Sequence):
        raw_groups = []
        for group in value:
            if isinstance(group, str) or not isinstance(group, Sequence):
                raise bad_value(option, expected, value)
            raw_groups.append(list(group))
    else:
        raise bad_value(option, expected, value)
    groups: list[tuple[int, ...]] = []
    owner: dict[int, int] = {}
    for index, raw in enumerate(raw_groups):
        ids: list[int] = []
        for item in raw:
            if isinstance(item, str):
                text = item.strip()
                if not text:
                    raise SettingsError(
                        option, f"{option} has an empty GPU id in worker group {index} of {value!r} ({expected})"
                    )
                if not (text.isascii() and text.isdigit()):  # "²".isdigit() is true, and int() refuses it
                    raise SettingsError(
                        option, f"{option}: GPU id {item.strip()!r} in {value!r} is not a non-negative integer"
                    )
                gpu = int(text)
            elif isinstance(item, int) and not isinstance(item, bool) and item >= 0:
                gpu = item
            else:
                raise SettingsError(option, f"{option}: GPU id {item!r} in {value!r} is not a non-negative integer")
            if gpu in owner:
                where = (
                    f"twice in worker group {index}"
                    if owner[gpu] == index
                    else f"in worker groups {owner[gpu]} and {index}"
                )
                raise SettingsError(
                    option, f"{option}: GPU {gpu} appears {where} of {value!r}; a GPU may belong to only one worker"
                )
            owner[gpu] = index
            ids.append(gpu)
        if not ids:
            raise SettingsError(option, f"{option}: worker group {index} of {value!r} has no GPU ids ({expected})")
        groups.append(tuple(ids))
    return tuple(groups)


def parse_cors_origins(value: Any, option: str = "--cors-allow-origins") -> tuple[str, ...]:
    """``"https://a.example, http://localhost:3000"`` -> a tuple of origins; blank or None -> ``()``.

    Each origin is ``scheme://host[:port]`` (no path, no trailing slash — browsers send it that way), or ``*``
    alone for any origin.
    """
    value = blank_to_none(value)
    if value is None:
        return ()
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",")]
    elif isinstance(value, Sequence):
        items = []
        for part in value:
            if not isinstance(part, str):
                raise bad_value(option, "a comma-separated list of origins", value)
            items.append(part.strip())
    else:
        raise bad_value(option, "a comma-separated list of origins", value)
    origins = tuple(dict.fromkeys(item for item in items if item))
    for origin in origins:
        if origin == "*":
            if len(origins) > 1:
                raise SettingsError(option, f"{option}: '*' must be the only origin, got {value!r}")
            continue
        if not _ORIGIN.match(origin):
            raise SettingsError(
                option,
                f"{option}: {origin!r} is not an origin (scheme://host[:port], no path or trailing slash)",
            )
    return origins




def read_secret_file(option: str, path: str, limit: int = MAX_SECRET_FILE_BYTES) -> str:
    """The text of the file ``option`` names (a token), white space around it stripped: a regular file only
    (symbolic links followed, as a mounted secret is one), read no further than ``limit`` bytes, UTF-8. Every
    problem is a :class:`SettingsError` naming ``option`` and the path (cut when long): it read without bound
    (``/dev/zero`` grew without end, a pipe waited for ever) and named neither when the file was not UTF-8."""
    from pipelines.paths import NO_SUCH_FILE, read_at_most, regular_file_problem

    from .reasons import echo

    shown = echo(path, 80)
    problem = regular_file_problem(path)
    if problem == NO_SUCH_FILE:
        raise SettingsError(option, f"{option}: no such file {shown}")
    if problem is not None:
        raise SettingsError(option, f"{option}: {shown} {problem}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # swapped for a pipe since: no wait
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise SettingsError(option, f"{option}: {shown} is not a regular file")
        data = read_at_most(fd, limit)  # closes it
    except OSError as exc:
        raise SettingsError(option, f"{option}: {shown} cannot be read ({exc.strerror or exc})") from None
    if data is None:
        raise SettingsError(option, f"{option}: {shown} holds more than {limit} bytes; a token is at most {limit}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SettingsError(option, f"{option}: {shown} is not UTF-8 text (byte {exc.start} of it)") from None
    if not text.strip():
        raise SettingsError(option, f"{option}: {shown} is empty")
    return text.strip()
