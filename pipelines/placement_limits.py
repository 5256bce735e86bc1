"""How large a placement may be: the size of its file and how many ranks (worker processes) it may ask for.

A placement (the format of :mod:`pipelines.toy_world.placement`: one object per stage, each with a ``devices``
list and an optional ``world_size``) runs one process per rank in ``process`` mode, and each such process imports
torch and builds its stage's model: some 0.55 GB resident on the CPU before any session. Nothing bounded the count:
a placement of 500 ``"cpu"`` devices for one stage was taken and spawned 500 of them, and the host ran out of
memory. The bounds here are far past any one host's real use and far below that:

* :data:`MAX_STAGE_RANKS` ranks a stage: a stage's ranks are replicas, one per device, and the largest hosts
  have 16 accelerators; more ranks than that only share devices (a repeated ``"cpu"`` is fine in small numbers,
  as the tests' two-rank groups do);
* :data:`MAX_PLACEMENT_RANKS` ranks in all (the stages' world sizes summed): at most about 18 GB of processes.

Kept free of torch, so that ``chunkline run`` and ``chunkline stream-serve`` can say it of a ``--placement``
before any pipeline loads (:func:`ranks_problem`), and the toy world's :class:`~pipelines.toy_world.placement.
Placement` refuses the same when it is built from Python or by ``chunkline worker``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Final

__all__ = ["MAX_PLACEMENT_BYTES", "MAX_PLACEMENT_RANKS", "MAX_STAGE_RANKS", "placement_text", "ranks_problem",
           "stage_ranks_problem", "total_ranks_problem"]

#: the largest placement file read (a placement names a few stages: a few KiB)
MAX_PLACEMENT_BYTES: Final = 1 << 20
#: ranks (worker processes) one stage may ask for
MAX_STAGE_RANKS: Final = 16
#: ranks all the stages of one placement may ask for together
MAX_PLACEMENT_RANKS: Final = 32


def placement_text(source: str) -> tuple[str, str]:
    """A placement's JSON text, and where it came from for messages: ``source`` itself when it starts with ``{``
    (``inline placement JSON``), else the regular file it names, at most :data:`MAX_PLACEMENT_BYTES`. ValueError
    saying why not (OSError where the file cannot be read)."""
    from .paths import read_at_most

    text = source.strip()
    if text.startswith("{"):
        return text, "inline placement JSON"
    path = Path(text).expanduser()
    if not path.exists():
        raise ValueError(f"placement file {text!r} does not exist")
    if not path.is_file():  # a directory, a pipe, a device: reading one may never end
        raise ValueError(f"placement file {text!r} is not a regular file")
    where = f"placement file {text!r}"
    raw = read_at_most(path, MAX_PLACEMENT_BYTES)
    if raw is None:
        raise ValueError(f"{where} is larger than {MAX_PLACEMENT_BYTES >> 10} KiB")
    return raw.decode("utf-8-sig", errors="replace"), where  # (a byte-order mark first is no content)


def stage_ranks_problem(stage: str, ranks: int) -> str | None:
    """Why one stage's ``ranks`` are too many, naming the stage and the limit, or None."""
    if ranks <= MAX_STAGE_RANKS:
        return None
    return (f"stage {stage!r} asks for {ranks} ranks (one worker process each); a stage has at most "
            f"{MAX_STAGE_RANKS} (its ranks are replicas, one per device)")


def total_ranks_problem(ranks: Mapping[str, int]) -> str | None:
    """Why the stages' ranks (by stage) are too many together, naming each stage's count and the limit, or None."""
    total = sum(ranks.values())
    if total <= MAX_PLACEMENT_RANKS:
        return None
    each = ", ".join(f"{stage!r} {count}" for stage, count in ranks.items())
    return (f"the stages ask for {total} ranks in all ({each}); a placement has at most {MAX_PLACEMENT_RANKS} (each "
            f"rank is a process that imports torch, about 0.55 GB)")


def _asked_ranks(runtime: Mapping[object, object]) -> int:
    """The ranks a stage's runtime object asks for: the larger of its devices' count and its ``world_size`` (the
    pipeline refuses the two disagreeing, but either alone would be spawned)."""
    devices = runtime.get("devices")
    count = len(devices) if isinstance(devices, list) else 1
    world_size = runtime.get("world_size")
    if isinstance(world_size, int) and not isinstance(world_size, bool):
        count = max(count, world_size)
    return count


def ranks_problem(placement: object) -> str | None:
    """Why a parsed placement (decoded JSON) asks for more ranks than a placement may, or None: each top-level
    object with ``devices`` or ``world_size`` is a stage's runtime. Anything else about it is the pipeline's to
    judge (it says so as it loads)."""
    if not isinstance(placement, Mapping):
        return None
    ranks = {str(stage): _asked_ranks(runtime) for stage, runtime in placement.items()
             if isinstance(runtime, Mapping) and ("devices" in runtime or "world_size" in runtime)}
    for stage, count in ranks.items():
        if (problem := stage_ranks_problem(stage, count)) is not None:
            return problem
    return total_ranks_problem(ranks)
