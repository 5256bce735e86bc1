"""Retained-session capacity from measured device memory (reference B.5).

After warm-up each stage worker captures a :class:`DeviceMemorySnapshot` of its
device (CUDA through torch; host memory on CPU, so planning also works on
CPU-only machines). :func:`calculate_session_capacity` is pure integer
arithmetic over those snapshots and the per-role :class:`SessionMemoryBudget`:
it needs no torch and no device, so it is tested exactly. An explicit limit
only ever lowers the measured capacity.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

import attrs

from .errors import EngineError, shown

__all__ = [
    "GIB",
    "CapacityPlan",
    "DeviceCapacity",
    "DeviceMemorySnapshot",
    "InsufficientMemoryError",
    "SessionCapacityPolicy",
    "SessionMemoryBudget",
    "calculate_session_capacity",
    "capture_memory_snapshot",
]

GIB = 1024**3


class InsufficientMemoryError(EngineError, RuntimeError):
    """Not even one retained session fits on ``device``: free memory or move stages."""

    def __init__(self, device: str, shortfall_bytes: int, required_bytes: int, free_bytes: int) -> None:
        self.device = device
        self.shortfall_bytes = shortfall_bytes
        self.required_bytes = required_bytes
        self.free_bytes = free_bytes
        super().__init__(
            f"Insufficient memory for one retained session on device {device!r}: needs "
            f"{required_bytes} bytes (margin included), {free_bytes} free, short by {shortfall_bytes} bytes"
        )


def _require_int(where: str, name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True bytes is a bug, not a count
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")


@attrs.frozen
class SessionCapacityPolicy:
    """Safety margin per device (the larger of a percentage and a floor) and a hard cap."""

    safety_margin_percent: int | float = 5
    minimum_safety_margin_bytes: int = 2 * GIB
    max_capacity: int = 64

    def __attrs_post_init__(self) -> None:
        where = "SessionCapacityPolicy"
        pct = self.safety_margin_percent
        if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 <= pct < 100:
            raise ValueError(f"{where}: safety_margin_percent must be in [0, 100), got {pct!r}")
        _require_int(where, "minimum_safety_margin_bytes", self.minimum_safety_margin_bytes, 0)
        _require_int(where, "max_capacity", self.max_capacity, 1)

    def safety_margin(self, total_bytes: int) -> int:
        """Exact margin for a device; the percentage part is rounded up (err on the safe side)."""
        # str() so that a float percent means its decimal (0.1 is 1/10, not 0.1000000000000000055...)
        share = total_bytes * Fraction(str(self.safety_margin_percent)) / 100
        return max(math.ceil(share), self.minimum_safety_margin_bytes)


@attrs.frozen
class SessionMemoryBudget:
    """What one retained session costs a process of a role.

    ``replaced_warmup_transient_bytes`` is the part of the warm-up peak that the
    fixed slot pools replace (e.g. the DiT KV pool), so it is not counted twice.
    """

    persistent_bytes_per_session: int
    replaced_warmup_transient_bytes: int = 0

    def __attrs_post_init__(self) -> None:
        _require_int("SessionMemoryBudget", "persistent_bytes_per_session", self.persistent_bytes_per_session, 0)
        _require_int(
            "SessionMemoryBudget", "replaced_warmup_transient_bytes", self.replaced_warmup_transient_bytes, 0
        )


@attrs.frozen
class DeviceMemorySnapshot:
    """Memory facts of one process on one device, taken after warm-up.

    ``device`` is the grouping key ("cuda:0", "cpu"); processes that report the
    same key share one device's memory. On CPU the fields map host memory:
    total = MemTotal, free = MemAvailable (both capped by a cgroup limit),
    allocated = reserved = VmRSS, peak_allocated = peak_reserved = VmHWM.
    """

    role: str
    device: str
    rank: int
    process_id: int
    device_index: int | None
    device_name: str
    total_bytes: int
    free_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int

    def __attrs_post_init__(self) -> None:
        for name in ("role", "device", "device_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"DeviceMemorySnapshot: {name} must be a non-empty string, got {value!r}")
        where = f"DeviceMemorySnapshot(role={self.role!r}, device={self.device!r})"
        for name in ("rank", "process_id", "total_bytes", "free_bytes", "allocated_bytes", "reserved_bytes",
                     "peak_allocated_bytes", "peak_reserved_bytes"):
            _require_int(where, name, getattr(self, name), 0)
        if self.device_index is not None:
            _require_int(where, "device_index", self.device_index, 0)
        if self.free_bytes > self.total_bytes:
            raise ValueError(f"{where}: free_bytes {self.free_bytes} exceeds total_bytes {self.total_bytes}")
        # what holds at every instant on a real device (a peak is the maximum since the last reset, which resets
        # both peaks to the current values; memory is allocated out of what is reserved, and reserved out of the
        # device's total), so a snapshot that breaks it was mistyped or mixed up units
        for small, large in (("allocated_bytes", "reserved_bytes"), ("reserved_bytes", "total_bytes"),
                             ("allocated_bytes", "peak_allocated_bytes"), ("reserved_bytes", "peak_reserved_bytes"),
                             ("peak_allocated_bytes", "peak_reserved_bytes")):
            if getattr(self, small) > getattr(self, large):
                raise ValueError(f"{where}: {small} {getattr(self, small)} exceeds {large} {getattr(self, large)}")

    @property
    def reusable_reserve_bytes(self) -> int:
        """Cached by the allocator but unused: new session storage can take it without growing."""
        return self.reserved_bytes - self.allocated_bytes

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class DeviceCapacity:
    """The facts and the result for one device (what the server's metadata reports)."""

    device: str
    device_name: str
    process_count: int
    total_bytes: int
    free_bytes: int
    safety_margin_bytes: int
    reusable_reserve_bytes: int
    transient_bytes: int
    untracked_bytes_per_session: int
    persistent_bytes_by_role: tuple[tuple[str, int], ...]  # (role, bytes per session), summed over processes
    capacity: int
    required_bytes: int  # need at max(capacity, 1) sessions, margin included

    def to_dict(self) -> dict[str, Any]:
        facts = attrs.asdict(self)
        facts["persistent_bytes_by_role"] = dict(self.persistent_bytes_by_role)
        return facts


@attrs.frozen
class CapacityPlan:
    """The computed capacity, the limit in force, and why.

    ``computed_capacity`` is None when nothing was measured (no snapshots); the
    effective capacity is then the configured limit or 1.
    """

    computed_capacity: int | None
    effective_capacity: int
    configured_limit: int | None
    limiting_device: str | None
    devices: tuple[DeviceCapacity, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "computed_capacity": self.computed_capacity,
            "effective_capacity": self.effective_capacity,
            "configured_limit": self.configured_limit,
            "limiting_device": self.limiting_device,
            "devices": {d.device: d.to_dict() for d in self.devices},
        }


def _device_capacity(
    device: str,
    snapshots: list[DeviceMemorySnapshot],
    role_budgets: Mapping[str, SessionMemoryBudget],
    untracked: int,
    policy: SessionCapacityPolicy,
) -> DeviceCapacity:
    total = min(s.total_bytes for s in snapshots)
    free = min(s.free_bytes for s in snapshots)
    margin = policy.safety_margin(total)
    # per process: (persistent per session, transient peak, reusable allocator reserve)
    terms: list[tuple[int, int, int]] = []
    by_role: dict[str, int] = {}
    for snap in snapshots:
        budget = role_budgets[snap.role]
        peak = max(snap.peak_allocated_bytes - snap.allocated_bytes, 0)
        transient = max(peak - budget.replaced_warmup_transient_bytes, 0)
        terms.append((budget.persistent_bytes_per_session, transient, snap.reusable_reserve_bytes))
        by_role[snap.role] = by_role.get(snap.role, 0) + budget.persistent_bytes_per_session

    def need(c: int) -> int:
        return c * untracked + sum(max(c * p + t - r, 0) for p, t, r in terms) + margin

    # need() is non-decreasing in c: binary search the largest c in [0, max] that fits
    capacity = 0
    if need(0) <= free:
        low, high = 0, policy.max_capacity
        while low < high:
            mid = (low + high + 1) // 2
            if need(mid) <= free:
                low = mid
            else:
                high = mid - 1
        capacity = low
    return DeviceCapacity(
        device=device,
        device_name=snapshots[0].device_name,
        process_count=len(snapshots),
        total_bytes=total,
        free_bytes=free,
        safety_margin_bytes=margin,
        reusable_reserve_bytes=sum(r for _, _, r in terms),
        transient_bytes=sum(t for _, t, _ in terms),
        untracked_bytes_per_session=untracked,
        persistent_bytes_by_role=tuple(sorted(by_role.items())),
        capacity=capacity,
        required_bytes=need(max(capacity, 1)),
    )


def _snapshot_list(where: str, snapshots: object) -> tuple[DeviceMemorySnapshot, ...]:
    """The snapshots as a tuple, each a DeviceMemorySnapshot, and at most one per process and device: its figures
    are the whole process's memory on the device, so a second one (the same snapshot twice, or one per role or
    rank of one process) would count that memory twice."""
    if isinstance(snapshots, DeviceMemorySnapshot):
        raise ValueError(f"{where}: snapshots must be an iterable of DeviceMemorySnapshot, got one snapshot "
                         f"(pass [snapshot])")
    try:
        items = tuple(snapshots)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{where}: snapshots must be an iterable of DeviceMemorySnapshot, "
                         f"got {type(snapshots).__name__} {shown(snapshots)}") from None
    seen: dict[tuple[str, int], DeviceMemorySnapshot] = {}
    for index, snap in enumerate(items):
        if not isinstance(snap, DeviceMemorySnapshot):
            raise ValueError(f"{where}: snapshots[{index}] must be a DeviceMemorySnapshot, "
                             f"got {type(snap).__name__} {shown(snap)}")
        first = seen.setdefault((snap.device, snap.process_id), snap)
        if len(seen) <= index:  # its process and device were seen before
            raise ValueError(
                f"{where}: snapshots[{index}] measures process {snap.process_id} on device {snap.device!r} again "
                f"(role {first.role!r} rank {first.rank}, then role {snap.role!r} rank {snap.rank}): take one "
                "snapshot per process and device (give processes on different hosts distinct device keys)"
            )
    return items


def calculate_session_capacity(
    snapshots: Iterable[DeviceMemorySnapshot],
    role_budgets: Mapping[str, SessionMemoryBudget],
    configured_limit: int | None,
    untracked_bytes_per_session: int = 0,
    policy: SessionCapacityPolicy = SessionCapacityPolicy(),
) -> CapacityPlan:
    """How many sessions every device can retain at once; the most constrained device decides.

    Raises :class:`InsufficientMemoryError` (naming the device and the shortfall
    for one session) when some device cannot hold a single session.
    """
    where = "calculate_session_capacity"
    if configured_limit is not None:
        _require_int(where, "configured_limit", configured_limit, 1)
    _require_int(where, "untracked_bytes_per_session", untracked_bytes_per_session, 0)
    if not isinstance(role_budgets, Mapping):
        raise ValueError(f"{where}: role_budgets must be a mapping of role to SessionMemoryBudget, "
                         f"got {type(role_budgets).__name__} {shown(role_budgets)}")
    for role, budget in role_budgets.items():
        if not isinstance(budget, SessionMemoryBudget):
            raise ValueError(f"role {role!r}: budget must be a SessionMemoryBudget, got {budget!r}")
    snapshots = _snapshot_list(where, snapshots)
    groups: dict[str, list[DeviceMemorySnapshot]] = {}
    for snap in snapshots:
        if snap.role not in role_budgets:
            raise ValueError(
                f"snapshot of role {snap.role!r} on device {snap.device!r} has no SessionMemoryBudget "
                f"(known roles: {sorted(role_budgets)})"
            )
        groups.setdefault(snap.device, []).append(snap)
    if not groups:
        fallback = configured_limit if configured_limit is not None else 1
        return CapacityPlan(None, fallback, configured_limit, None)
    devices = tuple(
        _device_capacity(name, groups[name], role_budgets, untracked_bytes_per_session, policy)
        for name in sorted(groups)
    )
    limiting = min(devices, key=lambda d: d.capacity)  # first in name order on ties
    if limiting.capacity < 1:
        raise InsufficientMemoryError(
            limiting.device,
            limiting.required_bytes - limiting.free_bytes,
            limiting.required_bytes,
            limiting.free_bytes,
        )
    effective = limiting.capacity if configured_limit is None else min(limiting.capacity, configured_limit)
    return CapacityPlan(limiting.capacity, effective, configured_limit, limiting.device, devices)


# -- capture (runs inside a stage worker, after warm-up) ----------------------------------------------


def capture_memory_snapshot(
    role: str, device: object = "cpu", *, rank: int | None = None, device_key: str | None = None
) -> DeviceMemorySnapshot:
    """Measure this process's memory on ``device`` ("cpu", "cuda", "cuda:N", an int or a torch.device).

    Call it in the thread that ran warm-up. ``rank`` defaults to the
    torch.distributed rank (0 when uninitialized). ``device_key`` overrides the
    grouping key when local indices do not identify one physical device across
    processes (e.g. different CUDA_VISIBLE_DEVICES).
    """
    if device_key is not None and (not isinstance(device_key, str) or not device_key):
        raise ValueError(f"capture_memory_snapshot: device_key must be a non-empty string or None, "
                         f"got {shown(device_key)}")
    text = f"cuda:{device}" if isinstance(device, int) and not isinstance(device, bool) else str(device)
    kind, _, index_text = text.partition(":")
    if kind not in ("cpu", "cuda") or (index_text and not (index_text.isascii() and index_text.isdigit())):
        raise ValueError(f"capture_memory_snapshot: unsupported device {device!r} (use 'cpu' or 'cuda[:N]')")
    if rank is None:
        rank = _distributed_rank()
    if kind == "cpu":
        return _capture_cpu(role, rank, "cpu" if device_key is None else device_key)
    return _capture_cuda(role, int(index_text) if index_text else None, rank, device_key)


def _distributed_rank() -> int:
    # only ask torch.distributed if this process already loaded it; a CPU capture must not import torch
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def _capture_cuda(role: str, index: int | None, rank: int, device_key: str | None) -> DeviceMemorySnapshot:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"capture_memory_snapshot: CUDA is not available for role {role!r}")
    if index is None:
        index = torch.cuda.current_device()
    torch.cuda.synchronize(index)  # pending kernels still hold their workspaces
    free, total = torch.cuda.mem_get_info(index)
    return DeviceMemorySnapshot(
        role=role,
        device=device_key or f"cuda:{index}",
        rank=rank,
        process_id=os.getpid(),
        device_index=index,
        device_name=torch.cuda.get_device_name(index),
        total_bytes=int(total),
        free_bytes=int(free),
        allocated_bytes=int(torch.cuda.memory_allocated(index)),
        reserved_bytes=int(torch.cuda.memory_reserved(index)),
        peak_allocated_bytes=int(torch.cuda.max_memory_allocated(index)),
        peak_reserved_bytes=int(torch.cuda.max_memory_reserved(index)),
    )


def _read_kib_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    found: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in names:
                    found[key] = int(rest.split()[0]) * 1024  # values are in kB
    except OSError as exc:
        raise RuntimeError(f"capture_memory_snapshot: cannot read {path} (Linux /proc required): {exc}") from exc
    missing = [n for n in names if n not in found]
    if missing:
        raise RuntimeError(f"capture_memory_snapshot: {path} lacks {missing}")
    return found


def _cgroup_limit() -> tuple[int, int] | None:
    """(limit, usage) of this container's memory cgroup, v2 or v1; None when unlimited or unknown."""
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path, encoding="ascii") as f:
                limit_text = f.read().strip()
            with open(usage_path, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit():
            return int(limit_text), usage
    return None


def _capture_cpu(role: str, rank: int, device_key: str) -> DeviceMemorySnapshot:
    host = _read_kib_fields("/proc/meminfo", ("MemTotal", "MemAvailable"))
    proc = _read_kib_fields("/proc/self/status", ("VmRSS", "VmHWM"))
    total, free = host["MemTotal"], host["MemAvailable"]
    limit = _cgroup_limit()
    if limit is not None and limit[0] < total:  # a container sees the host's MemTotal, not its own limit
        total = limit[0]
        free = min(free, max(limit[0] - limit[1], 0))
    rss = proc["VmRSS"]
    hwm = max(proc["VmHWM"], rss)
    # resident pages may exceed the cgroup's limit (pages charged to another cgroup: a segment another container
    # shared) or even MemTotal (a page mapped twice counts twice): the total is never below them
    total = max(total, rss)
    return DeviceMemorySnapshot(
        role=role,
        device=device_key,
        rank=rank,
        process_id=os.getpid(),
        device_index=None,
        device_name="host memory",
        total_bytes=total,
        free_bytes=min(free, total),
        allocated_bytes=rss,
        reserved_bytes=rss,  # the host allocator's cache is not visible; claim no reusable reserve
        peak_allocated_bytes=hwm,
        peak_reserved_bytes=hwm,
    )
