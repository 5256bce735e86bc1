"""The CPU side of :class:`~engine.tensor_channel.WorkerTensorChannel`: POSIX shared memory.

* :class:`Segment`: one mapping (what ``SharedMemory`` does, without the
  resource tracker, so children never unlink what the parent owns).
* :class:`ControlLayout`: where each word of the channel's control segment is.
* :class:`CpuSlotPool`: the producer's persistent slot segments, per profile
  (tensor index, shape, dtype), ``CPU_SLOTS`` round-robin slots each. A slot's
  header is written once, when its segment is created (shape, dtype and size
  never change for a profile); a send only copies the tensor into the slot's
  persistent typed view and stores the transfer id (seq) around it.
* :func:`slot_view`: the consumer's typed view of a slot, built once per
  attached segment from its header.

Slot header words: ``[seq, transfer id, nbytes, dtype code, ndim, dims...]``;
seq is 0 while the producer writes the slot, then the transfer id it holds.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import Any

import attrs
import torch

from .shm_names import unlink
from .tensor_channel_refs import TensorChannelError

try:  # the primitive multiprocessing.shared_memory is built on
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

SHARED_MEMORY = _posixshmem is not None  # whether this platform has POSIX shared memory

__all__ = [
    "SHARED_MEMORY",
    "ACK_WINDOW", "CPU_SLOTS", "DTYPES", "DTYPE_CODE", "HDR_BYTES", "MAX_NDIM", "MAX_PROFILES",
    "ControlLayout", "CpuPayload", "CpuSlotPool", "Segment", "release_owned", "slot_view", "unlink",
]

MAX_PROFILES = 8  # pooled profiles per channel (CPU pool; CUDA pool separately)
CPU_SLOTS = 2
ACK_WINDOW = 64  # transfers in flight at most (ack ring length per rank)
MAX_NDIM = 16
HDR_BYTES = 256  # 5 + MAX_NDIM words, rounded up: the data stays 64-byte aligned
MAGIC = 0x43484E4C  # "CHNL"

DTYPES: tuple[torch.dtype, ...] = tuple(
    d
    for d in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
        torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
        getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
    )
    if d is not None
)
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}


@attrs.frozen
class ControlLayout:
    """Word indices of the control segment for ``world_size`` consumer ranks.

    ``[magic, producer pid, last transfer id, epoch per profile entry...,
    through per rank..., ack ring per rank..., hold ring per rank...]``. Acks:
    ``+k`` copied or released, ``-k`` discarded; holds: ``k`` while the rank
    holds a zero-copy view of transfer ``k``.
    """

    world_size: int
    MAGIC = 0
    PRODUCER = 1
    LAST_TID = 2
    EPOCHS = 3

    @property
    def words(self) -> int:
        return self.EPOCHS + MAX_PROFILES + self.world_size * (1 + 2 * ACK_WINDOW)

    def epoch(self, entry: int) -> int:
        return self.EPOCHS + entry

    def through(self, rank: int) -> int:
        return self.EPOCHS + MAX_PROFILES + rank

    def ack(self, rank: int, tid: int) -> int:
        return self.EPOCHS + MAX_PROFILES + self.world_size + rank * ACK_WINDOW + tid % ACK_WINDOW

    def hold(self, rank: int, tid: int) -> int:
        return self.ack(rank, tid) + self.world_size * ACK_WINDOW


class Segment:
    """A POSIX shared-memory mapping; ``views`` caches typed views of its data (dropped on close)."""

    def __init__(self, name: str, size: int = 0, create: bool = False) -> None:
        self.name = name
        self.epoch = 0
        self.views: dict[Any, torch.Tensor] = {}
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
                if size:
                    _reserve(fd, name, size)
            self.size = os.fstat(fd).st_size
            try:
                self.mm = mmap.mmap(fd, self.size)
            except OSError as exc:  # no address space left for it (a process memory limit)
                raise TensorChannelError(
                    f"a shared-memory segment of {self.size} bytes cannot be mapped ({exc.strerror})") from exc
        except BaseException:
            if create:  # a segment made and not mapped is nobody's: it stayed in /dev/shm for good
                unlink(name)
            raise
        finally:
            os.close(fd)
        self._base = memoryview(self.mm)
        self.words = self._base[: self.size // 8 * 8].cast("q")
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8) if self.size else None

    def data(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The data area as a ``dtype`` tensor of ``shape`` (cached)."""
        key = (dtype, shape)
        view = self.views.get(key)
        if view is None:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            view = self.views[key] = self.bytes[HDR_BYTES : HDR_BYTES + nbytes].view(dtype).view(shape)
        return view

    def close(self) -> None:
        if self.mm is None:
            return
        self.views.clear()
        self.words.release()
        self._base.release()
        self.bytes = None
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere (a zero-copy tensor); the mapping goes with it
            pass
        self.mm = None


def _reserve(fd: int, name: str, size: int) -> None:
    """Take a new segment's pages from /dev/shm now, or unlink it and raise a TensorChannelError.

    ``ftruncate`` alone only sets the size: a segment larger than what /dev/shm has free maps fine,
    and the first write past the free space kills the process with SIGBUS.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        unlink(name)
        raise TensorChannelError(
            f"a shared-memory segment of {size} bytes does not fit in /dev/shm ({exc.strerror}); "
            f"free some, or give the host (or the container: --shm-size) more"
        ) from exc


def _remove(segments: list[Segment]) -> None:
    """Unmap and unlink segments this process made (a profile evicted, or made after its channel closed)."""
    for segment in segments:
        segment.close()
        unlink(segment.name)


def data_name(prefix: str, entry: int, epoch: int, slot: int) -> str:
    return f"{prefix}p{entry}e{epoch}s{slot}"


def release_owned(control: Segment, prefix: str, state: dict) -> None:
    """Unlink every data segment registered in the control segment, then the control segment."""
    if state["closed"]:
        return
    state["closed"] = True
    if control.mm is not None:
        control.words[ControlLayout.MAGIC] = 0  # before the epochs are read: a producer creating a segment sees it
        for entry in range(MAX_PROFILES):
            epoch = control.words[ControlLayout.EPOCHS + entry]
            for slot in range(CPU_SLOTS):
                if epoch:
                    unlink(data_name(prefix, entry, epoch, slot))
    control.close()
    unlink(prefix + "ctl")


@attrs.frozen
class CpuPayload:
    name: str  # data segment
    entry: int
    epoch: int
    slot: int
    count: int  # tensors in the transfer


@attrs.define(eq=False)
class _Profile:
    entry: int
    epoch: int
    segments: list[Segment]
    views: list[torch.Tensor]  # per slot: the flat typed data view
    last: list[int]  # transfer id last written per slot (0 = never)
    next: int = 0
    used: int = 0


Wait = Callable[[list[int], str], None]  # wait until these transfers are resolved by every rank


class CpuSlotPool:
    """The producer's slot segments (one pool per channel per producer process)."""

    def __init__(self, prefix: str, control: Callable[[], Any]) -> None:
        self.prefix = prefix
        self._control = control  # -> the control segment's words
        self.profiles: dict[tuple, _Profile] = {}
        self._uses = 0

    def write(self, tid: int, index: int, t: torch.Tensor, count: int, wait: Wait) -> CpuPayload:
        """Copy ``t`` into the next slot of its profile once that slot is free; return the payload."""
        shape = tuple(t.shape)
        profile = self._profile((index, shape, t.dtype), t, wait)
        slot = profile.next
        profile.next = (slot + 1) % CPU_SLOTS
        wait([profile.last[slot]], f"slot {slot} of tensor {index}")
        segment = profile.segments[slot]
        header = segment.words
        header[0] = 0  # seqlock: being written
        if t.numel():
            profile.views[slot].copy_(t.view(-1) if t.is_contiguous() else t.reshape(-1))
        header[1] = tid
        header[0] = tid
        profile.last[slot] = tid
        return CpuPayload(segment.name, profile.entry, profile.epoch, slot, count)

    def _profile(self, key: tuple, t: torch.Tensor, wait: Wait) -> _Profile:
        self._uses += 1
        profile = self.profiles.get(key)
        if profile is None:
            if len(self.profiles) < MAX_PROFILES:
                entry = len(self.profiles)
            else:  # evict the least recently used profile once its slots are released
                old_key = min(self.profiles, key=lambda k: self.profiles[k].used)
                old = self.profiles.pop(old_key)
                wait(old.last, f"evicting profile {old.entry}")
                old.views.clear()
                _remove(old.segments)
                entry = old.entry
            words = self._control()
            epoch = words[ControlLayout.EPOCHS + entry] + 1
            words[ControlLayout.EPOCHS + entry] = epoch  # registered before created: the parent can unlink it
            nbytes = t.numel() * t.element_size()
            segments: list[Segment] = []
            try:
                for s in range(CPU_SLOTS):  # one that cannot be made takes those made before it away with it
                    segments.append(
                        Segment(data_name(self.prefix, entry, epoch, s), HDR_BYTES + (nbytes + 63) // 64 * 64, create=True))
                self._control()  # raises once the owner closed the channel: it may not have seen this epoch
            except BaseException:
                _remove(segments)  # this epoch's: the parent's close unlinks only an entry's latest epoch
                raise
            for segment in segments:  # the header never changes for a profile: written once
                header = segment.words
                header[0], header[1], header[2], header[3], header[4] = 0, 0, nbytes, DTYPE_CODE[t.dtype], t.dim()
                for k, size in enumerate(t.shape):
                    header[5 + k] = size
            views = [s.data(t.dtype, (t.numel(),)) for s in segments]
            profile = self.profiles[key] = _Profile(entry, epoch, segments, views, [0] * CPU_SLOTS)
        profile.used = self._uses
        return profile

    def close(self) -> None:
        for profile in self.profiles.values():
            profile.views.clear()
            for segment in profile.segments:
                segment.close()
        self.profiles.clear()

    def segment(self, name: str) -> Segment | None:
        """The producer's own segment of that name (a producer may also consume, e.g. in tests)."""
        for profile in self.profiles.values():
            for segment in profile.segments:
                if segment.name == name:
                    return segment
        return None


def read_header(segment: Segment) -> tuple[int, int, int, tuple[int, ...]] | None:
    """``(seq, nbytes, dtype code, shape)`` of a slot, or None when the header is not valid."""
    header = segment.words
    code, ndim = header[3], header[4]
    if not 0 <= code < len(DTYPES) or not 0 <= ndim <= MAX_NDIM:
        return None
    return header[0], header[2], code, tuple(header[5 + k] for k in range(ndim))


def slot_view(segment: Segment, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> torch.Tensor:
    """The slot's data as a ``dtype`` tensor of ``shape`` (a fresh empty tensor when it holds no bytes)."""
    return segment.data(dtype, shape) if nbytes else torch.empty(shape, dtype=dtype)
