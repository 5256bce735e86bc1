"""GPU ids between processes: what a worker's group means in the process that starts it and in the one that runs it.

A GPU id in ``--worker-gpu-map`` (and an agent's ``--devices`` when its ``CUDA_VISIBLE_DEVICES`` does not list
it) is a CUDA device as the process that reads it sees it: its position among the GPUs ``CUDA_VISIBLE_DEVICES``
lets the process use, or the host's GPU id when the variable is not set. A child process that gets a group sees only
that group: its ``CUDA_VISIBLE_DEVICES`` lists the parent's entries for those ids, so the child's GPU 0 is the
parent's first GPU of the group, whatever the parent was itself given.

An id beyond the GPUs the process can use names nothing: on a host without CUDA a map was taken without a word and
every worker ran on the CPU, and on a host with GPUs a worker died in its load on an invalid device ordinal.
:func:`missing_gpus` says so at start.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["visible_gpu_count", "missing_gpus", "child_visible_devices", "agent_devices", "ordinals_in_this_process"]

_VARIABLE = "CUDA_VISIBLE_DEVICES"


def visible_gpu_count() -> int:
    """How many CUDA GPUs this process may use (0 without CUDA); asked of NVML where torch can, so the parent that
    asks never initializes CUDA itself."""
    import torch

    return torch.cuda.device_count()


def _entries(environ: Mapping[str, str]) -> list[str] | None:
    value = environ.get(_VARIABLE)
    if value is None:
        return None
    return [entry.strip() for entry in value.split(",") if entry.strip()]


def missing_gpus(ids: Iterable[int], option: str, *, named: Sequence[int] | None = None, advise: bool = True,
                 environ: Mapping[str, str] = os.environ) -> str | None:
    """Why ``ids`` (read from ``option``) name GPUs this process cannot use, or None when it can use them all.
    ``named``: how ``option`` named each of ``ids`` (an agent's devices, before its ``CUDA_VISIBLE_DEVICES``);
    ``advise``: end with what to give instead (not for an agent whose launcher gave them)."""
    ids = list(ids)
    if not ids:
        return None
    count = visible_gpu_count()
    beyond = sorted({name for gpu, name in zip(ids, ids if named is None else named) if gpu >= count})
    if not beyond:
        return None
    limited = f", {_VARIABLE}={environ[_VARIABLE]!r}" if _VARIABLE in environ else ""
    counted = f"torch.cuda.device_count() is {count}{limited}"
    names = f"GPU{'s' if len(beyond) > 1 else ''} " + ", ".join(str(gpu) for gpu in beyond)
    usable = ("no CUDA GPU" if count == 0 else "1 CUDA GPU, 0" if count == 1 else f"{count} CUDA GPUs, 0-{count - 1}")
    advice = f"; leave {option} out to run on the CPU" if count == 0 else "; give ids among those"
    return f"{option} names {names}, but this process can use {usable} ({counted}){advice if advise else ''}"


def child_visible_devices(ids: Sequence[int], environ: Mapping[str, str] = os.environ) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of a child that gets the group ``ids`` (this process's view): the entries this
    process's own variable has at those positions, or the ids themselves when it has none."""
    listed = _entries(environ)
    if listed is None:
        return ",".join(str(gpu) for gpu in ids)
    beyond = [gpu for gpu in ids if gpu >= len(listed)]
    if beyond:  # (a map is checked at start: see missing_gpus)
        raise ValueError(f"GPU {beyond[0]} is not among the {len(listed)} that {_VARIABLE}={environ[_VARIABLE]!r} lists")
    return ",".join(listed[gpu] for gpu in ids)


def agent_devices(ids: Sequence[int], environ: Mapping[str, str] = os.environ) -> tuple[str, tuple[int, ...]]:
    """What an agent started with the group ``ids`` (this process's view) gets: its ``CUDA_VISIBLE_DEVICES``, and
    its ``--devices``, the GPU ids that variable lists (so the agent finds each there), or, where it lists them by
    another name (a UUID), the agent's own 0, 1, ... No group (no ``--worker-gpu-map``) is no devices, as an
    in-process worker has none (each agent was handed GPU 0 and ``gpu_num=1``)."""
    if not ids:
        return "", ()
    visible = child_visible_devices(ids, environ)
    entries = visible.split(",")
    if all(entry.isascii() and entry.isdigit() for entry in entries):
        return visible, tuple(int(entry) for entry in entries)
    return visible, tuple(range(len(entries)))


def ordinals_in_this_process(devices: Sequence[int], environ: Mapping[str, str] = os.environ) -> tuple[int, ...]:
    """The CUDA device numbers, in this process, of an agent's ``devices``: where ``CUDA_VISIBLE_DEVICES`` lists each
    of them (as its launcher sets it: the group's ids, in order) their positions there, else the ids themselves."""
    listed = _entries(environ)
    if listed is not None and all(str(device) in listed for device in devices):
        return tuple(listed.index(str(device)) for device in devices)
    return tuple(devices)
