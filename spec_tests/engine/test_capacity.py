"""Retained-session capacity (reference B.5): the pure calculation, its errors, and real captures.

The calculation cases are a table: each row gives the snapshots, budgets and
limits, and the exact capacity worked out by hand in GiB. Capacity is the
largest c <= max_capacity with
``c*untracked + sum_process max(c*persistent + transient - reserve, 0) + margin <= free``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import capacity
from engine.capacity import (
    GIB,
    CapacityPlan,
    DeviceMemorySnapshot,
    InsufficientMemoryError,
    SessionCapacityPolicy,
    SessionMemoryBudget,
    calculate_session_capacity,
    capture_memory_snapshot,
)


_process_ids = itertools.count(1000)


def snap(
    role: str = "denoise",
    device: str = "cuda:0",
    *,
    total: int = 100,
    free: int = 50,
    allocated: int = 20,
    reserve: int = 0,
    transient: int = 0,
    unit: int = GIB,
    process_id: int | None = None,
) -> DeviceMemorySnapshot:
    """A snapshot in GiB of a process of its own (unless ``process_id`` is given): reserved = allocated + reserve,
    peak allocated = allocated + transient (so the peak reserved is at least that too)."""
    return DeviceMemorySnapshot(
        role=role, device=device, rank=0, process_id=next(_process_ids) if process_id is None else process_id,
        device_index=int(device.partition(":")[2] or 0),
        device_name="Test GPU", total_bytes=total * unit, free_bytes=free * unit,
        allocated_bytes=allocated * unit, reserved_bytes=(allocated + reserve) * unit,
        peak_allocated_bytes=(allocated + transient) * unit,
        peak_reserved_bytes=(allocated + max(reserve, transient)) * unit,
    )


def budgets(**persistent_gib: int) -> dict[str, SessionMemoryBudget]:
    return {role: SessionMemoryBudget(gib * GIB) for role, gib in persistent_gib.items()}


DEFAULT = SessionCapacityPolicy()  # margin max(5% of 100 GiB, 2 GiB) = 5 GiB on the default snapshot

# id, snapshots, role budgets, untracked GiB, policy, configured limit, computed, effective, limiting device
CASES = [
    ("single device: 4c + 5 <= 50", [snap()], budgets(denoise=4), 0, DEFAULT, None, 11, 11, "cuda:0"),
    ("most constrained device limits the plan",
     [snap(), snap("vae_decode", "cuda:1", free=30)], budgets(denoise=4, vae_decode=4), 0, DEFAULT, None,
     6, 6, "cuda:1"),
    ("role budgets sum across processes on one device: (4+1)c + 5 <= 50",
     [snap(), snap("vae_decode")], budgets(denoise=4, vae_decode=1), 0, DEFAULT, None, 9, 9, "cuda:0"),
    ("two processes of one role on one device count twice: 8c + 5 <= 50",
     [snap(), snap()], budgets(denoise=4), 0, DEFAULT, None, 5, 5, "cuda:0"),
    ("free and total are the minimum over the processes: 5c + 5 <= 48",
     [snap(free=50), snap("vae_decode", free=48)], budgets(denoise=4, vae_decode=1), 0, DEFAULT, None,
     8, 8, "cuda:0"),
    ("untracked bytes per session: (1+4)c + 5 <= 50",
     [snap()], budgets(denoise=4), 1, DEFAULT, None, 9, 9, "cuda:0"),
    ("untracked bytes count once per device, not per process: 1c + (4+1)c + 5 <= 50",
     [snap(), snap("vae_decode")], budgets(denoise=4, vae_decode=1), 1, DEFAULT, None, 7, 7, "cuda:0"),
    ("reusable allocator reserve is credited: max(4c - 6, 0) + 5 <= 50",
     [snap(reserve=6)], budgets(denoise=4), 0, DEFAULT, None, 12, 12, "cuda:0"),
    ("reserve credit is per process, never negative: max(4c-40,0) + 4c + 5 <= 50",
     [snap(reserve=40), snap("vae_decode")], budgets(denoise=4, vae_decode=4), 0, DEFAULT, None,
     10, 10, "cuda:0"),
    ("warm-up transient peaks are kept free: 4c + 10 + 5 <= 50",
     [snap(transient=10)], budgets(denoise=4), 0, DEFAULT, None, 8, 8, "cuda:0"),
    ("reserve offsets the transient too: max(4c + 10 - 6, 0) + 5 <= 50",
     [snap(transient=10, reserve=6)], budgets(denoise=4), 0, DEFAULT, None, 10, 10, "cuda:0"),
    ("replaced warm-up transient is not counted twice: 4c + (10-8) + 5 <= 50",
     [snap(transient=10)], {"denoise": SessionMemoryBudget(4 * GIB, 8 * GIB)}, 0, DEFAULT, None,
     10, 10, "cuda:0"),
    ("replacement larger than the transient floors at 0: 4c + 0 + 5 <= 50",
     [snap(transient=10)], {"denoise": SessionMemoryBudget(4 * GIB, 20 * GIB)}, 0, DEFAULT, None,
     11, 11, "cuda:0"),
    ("percentage margin: 10% of 100 = 10 GiB, 4c + 10 <= 50",
     [snap()], budgets(denoise=4), 0, SessionCapacityPolicy(10), None, 10, 10, "cuda:0"),
    ("minimum margin wins on a small device: max(0.5, 2) = 2 GiB, 1c + 2 <= 9",
     [snap(total=10, free=9, allocated=1)], budgets(denoise=1), 0, DEFAULT, None, 7, 7, "cuda:0"),
    ("zero cost per session is capped at max_capacity",
     [snap()], budgets(denoise=0), 0, DEFAULT, None, 64, 64, "cuda:0"),
    ("a lower max_capacity caps the plan",
     [snap()], budgets(denoise=1), 0, SessionCapacityPolicy(max_capacity=8), None, 8, 8, "cuda:0"),
    ("an explicit limit lowers the effective capacity",
     [snap()], budgets(denoise=4), 0, DEFAULT, 4, 11, 4, "cuda:0"),
    ("an explicit limit never raises it",
     [snap()], budgets(denoise=4), 0, DEFAULT, 100, 11, 11, "cuda:0"),
    ("exactly at the boundary fits: 4c + 5 <= 49 gives 11",
     [snap(free=49)], budgets(denoise=4), 0, DEFAULT, None, 11, 11, "cuda:0"),
    ("one byte short of the boundary does not: 4*11 + 5 GiB > 49 GiB - 1",
     [snap(free=49 * GIB - 1, total=100 * GIB, allocated=0, unit=1)], budgets(denoise=4), 0, DEFAULT, None,
     10, 10, "cuda:0"),
    ("host memory groups as one device 'cpu'",
     [snap(device="cpu"), snap("vae_decode", device="cpu")], budgets(denoise=2, vae_decode=2), 0, DEFAULT,
     None, 11, 11, "cpu"),
]


@pytest.mark.parametrize(
    "snapshots, role_budgets, untracked_gib, policy, limit, computed, effective, limiting",
    [pytest.param(*row[1:], id=row[0]) for row in CASES],
)
def test_capacity_table(snapshots, role_budgets, untracked_gib, policy, limit, computed, effective, limiting):
    plan = calculate_session_capacity(snapshots, role_budgets, limit, untracked_gib * GIB, policy)
    assert (plan.computed_capacity, plan.effective_capacity, plan.limiting_device) == (
        computed, effective, limiting
    )
    assert plan.configured_limit == limit


def test_insufficient_memory_names_the_device_and_the_shortfall():
    # cuda:0 fits 11; cuda:1 needs 4 + 5 = 9 GiB for one session with 6 GiB free
    snapshots = [snap(), snap("vae_decode", "cuda:1", free=6)]
    with pytest.raises(InsufficientMemoryError, match=r"'cuda:1'.*short by 3221225472 bytes") as info:
        calculate_session_capacity(snapshots, budgets(denoise=4, vae_decode=4), None)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert (err.device, err.shortfall_bytes, err.required_bytes, err.free_bytes) == (
        "cuda:1", 3 * GIB, 9 * GIB, 6 * GIB
    )


def test_insufficient_when_transients_alone_exceed_free_memory():
    with pytest.raises(InsufficientMemoryError, match="'cuda:0'") as info:
        calculate_session_capacity([snap(transient=60)], budgets(denoise=1), None)
    assert info.value.shortfall_bytes == (1 + 60 + 5 - 50) * GIB


def test_explicit_limit_does_not_hide_insufficient_memory():
    with pytest.raises(InsufficientMemoryError):
        calculate_session_capacity([snap(free=6)], budgets(denoise=4), 1)


@pytest.mark.parametrize("limit, effective", [(None, 1), (7, 7)])
def test_no_snapshots_falls_back_to_the_configured_limit_or_one(limit, effective):
    plan = calculate_session_capacity([], budgets(denoise=4), limit)
    assert plan == CapacityPlan(None, effective, limit, None, ())
    assert plan.to_dict()["devices"] == {}


def test_to_dict_reports_the_plan_and_per_device_facts():
    snapshots = [snap(transient=3, reserve=1), snap("vae_decode"), snap("vae_decode", "cuda:1", free=30)]
    plan = calculate_session_capacity(snapshots, budgets(denoise=4, vae_decode=1), 2, GIB)
    data = plan.to_dict()
    json.dumps(data)  # goes into the server's metadata as is
    assert {k: data[k] for k in ("computed_capacity", "effective_capacity", "configured_limit",
                                 "limiting_device")} == {
        "computed_capacity": 7, "effective_capacity": 2, "configured_limit": 2, "limiting_device": "cuda:0",
    }
    cuda0 = data["devices"]["cuda:0"]
    assert cuda0["persistent_bytes_by_role"] == {"denoise": 4 * GIB, "vae_decode": 1 * GIB}
    assert cuda0 | {"persistent_bytes_by_role": None} == {
        "device": "cuda:0", "device_name": "Test GPU", "process_count": 2, "total_bytes": 100 * GIB,
        "free_bytes": 50 * GIB, "safety_margin_bytes": 5 * GIB, "reusable_reserve_bytes": GIB,
        "transient_bytes": 3 * GIB, "untracked_bytes_per_session": GIB, "persistent_bytes_by_role": None,
        "capacity": 7, "required_bytes": (7 * 6 + 3 - 1 + 5) * GIB,
    }
    assert data["devices"]["cuda:1"]["capacity"] == 12  # (1 + 1)c + 5 <= 30


def _brute_force(free, margin, untracked, terms, max_capacity):
    fits = [c for c in range(max_capacity + 1)
            if c * untracked + sum(max(c * p + t - r, 0) for p, t, r in terms) + margin <= free]
    return max(fits, default=0)


process = st.tuples(st.integers(0, 10**12), st.integers(0, 10**12), st.integers(0, 10**12), st.integers(0, 10**12))


@settings(max_examples=300, deadline=None)
@given(st.lists(process, min_size=1, max_size=4), st.integers(0, 10**11), st.integers(2 * 10**12, 10**14),
       st.integers(1, 80))
def test_search_matches_brute_force_exactly(processes, untracked, total, max_capacity):
    """Integer arithmetic, no rounding: the result is the exact largest fitting c."""
    snapshots, role_budgets = [], {}
    for i, (persistent, allocated, reserve, transient) in enumerate(processes):
        role = f"r{i}"
        role_budgets[role] = SessionMemoryBudget(persistent)
        snapshots.append(DeviceMemorySnapshot(
            role, "cuda:0", 0, i, 0, "G", total, total // 2, allocated, allocated + reserve,
            allocated + transient, allocated + max(reserve, transient)))
    policy = SessionCapacityPolicy(max_capacity=max_capacity)
    terms = [(p, t, r) for p, _, r, t in processes]
    expected = _brute_force(total // 2, policy.safety_margin(total), untracked, terms, max_capacity)
    if expected == 0:
        with pytest.raises(InsufficientMemoryError):
            calculate_session_capacity(snapshots, role_budgets, None, untracked, policy)
    else:
        plan = calculate_session_capacity(snapshots, role_budgets, None, untracked, policy)
        assert plan.computed_capacity == expected


# -- validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    ({"safety_margin_percent": -1}, "safety_margin_percent"),
    ({"safety_margin_percent": 100}, "safety_margin_percent"),
    ({"safety_margin_percent": float("nan")}, "safety_margin_percent"),
    ({"safety_margin_percent": True}, "safety_margin_percent"),
    ({"safety_margin_percent": "5"}, "safety_margin_percent"),
    ({"minimum_safety_margin_bytes": -1}, "minimum_safety_margin_bytes"),
    ({"minimum_safety_margin_bytes": 1.5}, "minimum_safety_margin_bytes"),
    ({"max_capacity": 0}, "max_capacity"),
    ({"max_capacity": True}, "max_capacity"),
])
def test_policy_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SessionCapacityPolicy(**kwargs)


def test_policy_bounds_are_accepted():
    policy = SessionCapacityPolicy(0, 0, 1)
    assert policy.safety_margin(10**12) == 0
    assert SessionCapacityPolicy(99.5, 0).safety_margin(1000) == 995
    assert SessionCapacityPolicy(0.1, 0).safety_margin(1000) == 1  # the decimal 0.1, not its float error
    assert SessionCapacityPolicy(5, 0).safety_margin(1001) == 51  # rounded up


@pytest.mark.parametrize("args, field", [
    ((-1,), "persistent_bytes_per_session"),
    ((1.0,), "persistent_bytes_per_session"),
    ((0, -1), "replaced_warmup_transient_bytes"),
])
def test_budget_validation_names_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        SessionMemoryBudget(*args)


@pytest.mark.parametrize("changes, field", [
    ({"free_bytes": 101 * GIB}, "free_bytes"),
    ({"allocated_bytes": 21 * GIB}, "allocated_bytes"),
    ({"total_bytes": -1}, "total_bytes"),
    ({"device_index": -1}, "device_index"),
    ({"role": ""}, "role"),
    ({"device": ""}, "device"),
])
def test_snapshot_validation_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        attrs.evolve(snap(), **changes)


@pytest.mark.parametrize("changes, message", [
    ({"peak_allocated_bytes": 19 * GIB}, f"allocated_bytes {20 * GIB} exceeds peak_allocated_bytes {19 * GIB}"),
    ({"peak_reserved_bytes": 19 * GIB}, f"reserved_bytes {20 * GIB} exceeds peak_reserved_bytes {19 * GIB}"),
    ({"peak_allocated_bytes": 30 * GIB}, f"peak_allocated_bytes {30 * GIB} exceeds peak_reserved_bytes {20 * GIB}"),
    ({"allocated_bytes": 200 * GIB, "reserved_bytes": 200 * GIB, "peak_allocated_bytes": 200 * GIB,
      "peak_reserved_bytes": 200 * GIB}, f"reserved_bytes {200 * GIB} exceeds total_bytes {100 * GIB}"),
])
def test_a_snapshot_no_device_could_report_is_refused(changes, message):
    """A peak is the maximum since the last reset (which resets both to the current values), and memory is allocated
    out of what is reserved, reserved out of the device: each was accepted broken, as only allocated <= reserved
    was checked (a peak below the current value, or bytes given in the wrong unit, planned a wrong capacity)."""
    with pytest.raises(ValueError, match=f"^DeviceMemorySnapshot\\(role='denoise', device='cuda:0'\\): {message}$"):
        attrs.evolve(snap(), **changes)


def test_one_process_on_one_device_is_counted_once():
    """The same snapshot twice counted that process's memory twice (capacity 11 became 5, and its allocator
    reserve was credited twice); each snapshot is a whole process's memory on a device, whatever its role."""
    first = snap()
    for again in (first, attrs.evolve(first, role="vae_decode"), attrs.evolve(first, rank=1)):
        with pytest.raises(ValueError, match=f"^calculate_session_capacity: snapshots\\[1\\] measures process "
                                             f"{first.process_id} on device 'cuda:0' again"):
            calculate_session_capacity([first, again], budgets(denoise=4, vae_decode=1), None)
    # one process on two devices, or two processes on one, are two measurements
    other_device = attrs.evolve(first, device="cuda:1", device_index=1)
    plan = calculate_session_capacity([first, other_device], budgets(denoise=4), None)
    assert (plan.computed_capacity, len(plan.devices)) == (11, 2)
    assert calculate_session_capacity([first, snap()], budgets(denoise=4), None).computed_capacity == 5


@pytest.mark.parametrize("snapshots, role_budgets, message", [
    (snap(), budgets(denoise=4), "snapshots must be an iterable of DeviceMemorySnapshot, got one snapshot"),
    (None, budgets(denoise=4), "snapshots must be an iterable of DeviceMemorySnapshot, got NoneType None"),
    ([snap().to_dict()], budgets(denoise=4), "snapshots\\[0\\] must be a DeviceMemorySnapshot, got dict "),
    ([snap()], [("denoise", SessionMemoryBudget(GIB))],
     "role_budgets must be a mapping of role to SessionMemoryBudget, got list "),
    ([snap()], None, "role_budgets must be a mapping of role to SessionMemoryBudget, got NoneType None"),
])
def test_capacity_arguments_of_the_wrong_kind_are_refused_naming_them(snapshots, role_budgets, message):
    """A single snapshot was ``TypeError: ... not iterable``, a list of budgets ``AttributeError: ... items``."""
    with pytest.raises(ValueError, match=f"^calculate_session_capacity: {message}"):
        calculate_session_capacity(snapshots, role_budgets, None)


def test_snapshot_of_a_role_without_a_budget_is_refused():
    with pytest.raises(ValueError, match="'vae_encode'.*'cuda:0'"):
        calculate_session_capacity([snap("vae_encode")], budgets(denoise=4), None)


@pytest.mark.parametrize("limit", [0, -2, True, 1.5])
def test_configured_limit_must_be_a_positive_int(limit):
    with pytest.raises(ValueError, match="configured_limit"):
        calculate_session_capacity([snap()], budgets(denoise=4), limit)


def test_untracked_bytes_must_be_non_negative():
    with pytest.raises(ValueError, match="untracked_bytes_per_session"):
        calculate_session_capacity([snap()], budgets(denoise=4), None, -1)


# -- real captures ---------------------------------------------------------------------------------------


def test_cpu_capture_returns_sane_host_memory():
    snapshot = capture_memory_snapshot("denoise", "cpu")
    assert (snapshot.role, snapshot.device, snapshot.device_index, snapshot.rank) == ("denoise", "cpu", None, 0)
    assert snapshot.process_id == os.getpid()
    assert 0 < snapshot.free_bytes <= snapshot.total_bytes
    assert 0 < snapshot.allocated_bytes == snapshot.reserved_bytes < snapshot.total_bytes
    assert snapshot.peak_allocated_bytes == snapshot.peak_reserved_bytes >= snapshot.allocated_bytes
    plan = calculate_session_capacity(
        [snapshot], budgets(denoise=0), None, policy=SessionCapacityPolicy(0, 0, max_capacity=3)
    )
    assert (plan.computed_capacity, plan.limiting_device) == (3, "cpu")


@pytest.mark.parametrize("key", ["", 0, b"cpu"])
def test_capture_refuses_a_device_key_that_is_not_a_name(key):
    """An empty key fell back to "cpu" (or "cuda:N") unsaid, so processes meant apart were grouped as one device."""
    with pytest.raises(ValueError, match=f"^capture_memory_snapshot: device_key must be a non-empty string or None, "
                                         f"got {re.escape(repr(key))}$"):
        capture_memory_snapshot("denoise", "cpu", device_key=key)
    assert capture_memory_snapshot("denoise", "cpu", device_key="host-a").device == "host-a"


def test_cpu_capture_keeps_the_total_at_least_the_resident_set(monkeypatch):
    """Resident pages may exceed a container's limit (pages charged to another cgroup): the capture still makes a
    snapshot, whose total is never below what the process holds."""
    fields = {"MemTotal": 64 * GIB, "MemAvailable": 32 * GIB, "VmRSS": 6 * GIB, "VmHWM": 7 * GIB}
    monkeypatch.setattr(capacity, "_read_kib_fields", lambda path, names: {n: fields[n] for n in names})
    monkeypatch.setattr(capacity, "_cgroup_limit", lambda: (4 * GIB, 3 * GIB))
    snapshot = capture_memory_snapshot("denoise", "cpu")
    assert (snapshot.total_bytes, snapshot.free_bytes, snapshot.allocated_bytes) == (6 * GIB, GIB, 6 * GIB)


def test_cpu_capture_does_not_import_torch():
    code = ("import sys; import engine.capacity as c; c.capture_memory_snapshot('x', 'cpu'); "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("device", ["mps", "cuda:x", "cpu:1x", "tpu:0"])
def test_capture_rejects_unsupported_devices(device):
    with pytest.raises(ValueError, match="unsupported device"):
        capture_memory_snapshot("denoise", device)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_cuda_capture_after_warmup_sees_allocations_and_peaks():
    import torch

    index = torch.cuda.current_device()
    torch.cuda.reset_peak_memory_stats(index)
    kept = torch.empty(64 * 1024 * 1024, dtype=torch.uint8, device=f"cuda:{index}")
    scratch = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=f"cuda:{index}")
    del scratch  # a warm-up transient: freed but cached by the allocator
    snapshot = capture_memory_snapshot("denoise", "cuda")  # unspecified index -> current device
    assert (snapshot.device, snapshot.device_index) == (f"cuda:{index}", index)
    assert snapshot.device_name == torch.cuda.get_device_name(index)
    assert 0 < snapshot.free_bytes <= snapshot.total_bytes
    assert snapshot.allocated_bytes >= kept.numel()
    assert snapshot.peak_allocated_bytes - snapshot.allocated_bytes >= 128 * 1024 * 1024
    assert snapshot.reserved_bytes - snapshot.allocated_bytes >= 128 * 1024 * 1024  # reusable reserve
    plan = calculate_session_capacity([snapshot], budgets(denoise=0), None,
                                      policy=SessionCapacityPolicy(0, 0, max_capacity=2))
    assert plan.computed_capacity == 2
    del kept
