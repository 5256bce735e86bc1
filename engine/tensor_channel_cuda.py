"""The CUDA side of :class:`~engine.tensor_channel.WorkerTensorChannel`.

Pooled path: per (tensor index, shape, dtype, device) profile the producer keeps
``cuda_ipc_slots`` persistent device buffers (round robin), one interprocess
*ready* event per slot and one interprocess *done* event per (slot, consumer
rank). Each slot is shared once per rank through torch.multiprocessing's CUDA
reduction; the handles travel in the ref's private payload and consumers cache
what they open.

* send: wait (host, bounded) until the slot's previous transfer is acked or
  discarded by every rank (the shared ack ring), make the producer stream wait
  on the done events of the ranks that copied, copy into the slot, record ready.
* receive: the consumer stream waits on ready (only if not complete), copies
  its view out, records its done event; then the channel writes the ack.

At most ``max_profiles`` profiles are pooled; beyond that, or when a slot cannot
be allocated (OOM), a tensor is cloned and sent through torch.multiprocessing's
CUDA IPC (one share per rank); the producer keeps the clone until every rank
resolved the transfer. A fallback transfer discarded without being received
keeps its IPC block in torch's limbo until the producer exits.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch.multiprocessing.reductions import reduce_tensor

if TYPE_CHECKING:
    from .tensor_channel import WorkerTensorChannel, WorkerTensorRef

__all__ = ["CudaConsumer", "CudaFallbackPayload", "CudaPoolPayload", "CudaProducer"]


@attrs.frozen
class CudaPoolPayload:
    uid: str  # producer pid : profile number
    slot: int
    count: int
    device_index: int
    shares: tuple  # per consumer rank: (rebuild function, args) of the slot buffer
    ready_handle: bytes
    done_handles: tuple  # per consumer rank


@attrs.frozen
class CudaFallbackPayload:
    count: int
    shares: tuple  # per consumer rank: (rebuild function, args)


@attrs.define(eq=False)
class _Profile:
    uid: str
    buffers: list[torch.Tensor]
    shares: list[tuple]
    ready: list[Any]
    ready_handles: list[bytes]
    done: list[list[Any]]
    done_handles: list[tuple]
    last: list[int]
    next: int = 0


class CudaProducer:
    """The producer's persistent IPC pools (one per channel per producer process)."""

    def __init__(self, channel: WorkerTensorChannel, max_profiles: int) -> None:
        self.channel = channel
        self.max_profiles = max_profiles
        self.profiles: dict[tuple, _Profile | None] = {}
        self.fallback_keep: dict[int, list[torch.Tensor]] = {}

    def _make_profile(self, t: torch.Tensor) -> _Profile | None:
        world, slots = self.channel.world_size, self.channel.cuda_ipc_slots
        try:
            buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(slots)]
        except torch.cuda.OutOfMemoryError:
            return None
        ready = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        done = [[torch.cuda.Event(interprocess=True) for _ in range(world)] for _ in range(slots)]
        return _Profile(
            uid=f"{os.getpid()}:{len(self.profiles)}",
            buffers=buffers,
            shares=[tuple(reduce_tensor(b) for _ in range(world)) for b in buffers],
            ready=ready,
            ready_handles=[e.ipc_handle() for e in ready],
            done=done,
            done_handles=[tuple(e.ipc_handle() for e in row) for row in done],
            last=[0] * slots,
        )

    def send(self, tid: int, index: int, t: torch.Tensor, count: int, deadline: float) -> Any:
        channel = self.channel
        for old in [k for k in self.fallback_keep if all(channel.resolved(r, k) for r in range(channel.world_size))]:
            del self.fallback_keep[old]
        key = (index, tuple(t.shape), t.dtype, t.device)
        with torch.cuda.device(t.device):
            if key not in self.profiles and len([p for p in self.profiles.values() if p]) < self.max_profiles:
                self.profiles[key] = self._make_profile(t)
            profile = self.profiles.get(key)
            stream = torch.cuda.current_stream(t.device)
            if profile is None:
                clone = t.clone(memory_format=torch.contiguous_format)
                self.fallback_keep.setdefault(tid, []).append(clone)
                # the clone is made on this stream; torch's reduction records an event for the consumer
                return CudaFallbackPayload(count, tuple(reduce_tensor(clone) for _ in range(channel.world_size)))
            slot = profile.next
            profile.next = (slot + 1) % len(profile.buffers)
            previous = profile.last[slot]
            channel.wait_resolved([previous], f"CUDA slot {slot} of tensor {index}", deadline)
            for rank in range(channel.world_size):
                if previous and channel.ack_of(rank, previous) > 0:  # the rank copied: wait for its copy
                    stream.wait_event(profile.done[slot][rank])
            profile.buffers[slot].copy_(t)
            profile.ready[slot].record(stream)
            profile.last[slot] = tid
            return CudaPoolPayload(
                uid=profile.uid, slot=slot, count=count, device_index=t.device.index,
                shares=profile.shares[slot], ready_handle=profile.ready_handles[slot],
                done_handles=profile.done_handles[slot],
            )

    def close(self) -> None:
        if self.profiles:
            for profile in self.profiles.values():
                if profile is not None:
                    for event in profile.ready:
                        event.synchronize()
            torch.cuda.synchronize()
        self.profiles.clear()
        self.fallback_keep.clear()


class CudaConsumer:
    """A consumer process's opened slots and events."""

    def __init__(self, channel: WorkerTensorChannel) -> None:
        self.channel = channel
        self.slots: dict[tuple, torch.Tensor] = {}
        self.events: dict[bytes, Any] = {}

    def _event(self, device: torch.device, handle: bytes) -> Any:
        event = self.events.get(handle)
        if event is None:
            event = self.events[handle] = torch.cuda.Event.from_ipc_handle(device, handle)
        return event

    def receive(self, ref: WorkerTensorRef, rank: int, device: Any, dest: torch.Tensor | None = None) -> torch.Tensor:
        channel, payload = self.channel, ref.payload
        if isinstance(payload, CudaFallbackPayload):
            fn, args = payload.shares[rank]
            full = fn(*args)
            channel.validate(ref, rank, full.shape, str(full.dtype), full.numel() * full.element_size(), str(full.device))
            target = dest.device if dest is not None else torch.device(device) if device is not None else full.device
            with torch.cuda.device(full.device):
                out = _copy_to(channel.local_view(ref, rank, full), target, dest, ref)
            torch.cuda.current_stream(full.device).synchronize()  # the IPC block may be freed once `full` goes
            return out
        if not isinstance(payload, CudaPoolPayload):
            raise channel.mismatch(ref, rank, "payload", "a channel payload", type(payload).__name__)
        source = torch.device("cuda", payload.device_index)
        key = (payload.uid, payload.slot)
        full = self.slots.get(key)
        if full is None:
            fn, args = payload.shares[rank]
            full = self.slots[key] = fn(*args)
        if not ref.source_device.startswith("cuda"):
            raise channel.mismatch(ref, rank, "device", ref.source_device, str(full.device))
        channel.validate(ref, rank, full.shape, str(full.dtype), full.numel() * full.element_size(), None)
        if dest is not None:
            target = dest.device
        else:
            target = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        stream_device = target if target.type == "cuda" else source
        stream = torch.cuda.current_stream(stream_device)
        ready = self._event(source, payload.ready_handle)
        done = self._event(source, payload.done_handles[rank])
        if not ready.query():
            stream.wait_event(ready)
        with torch.cuda.device(stream_device), torch.cuda.stream(stream):
            out = _copy_to(channel.local_view(ref, rank, full), target, dest, ref)
            done.record(stream)
        return out

    def close(self) -> None:
        if self.slots or self.events:
            torch.cuda.synchronize()
        self.slots.clear()
        self.events.clear()


def _copy_to(view: torch.Tensor, target: torch.device, dest: torch.Tensor | None, ref: WorkerTensorRef) -> torch.Tensor:
    if dest is None:
        return view.to(target, copy=True, memory_format=torch.contiguous_format)
    from .tensor_channel_consumer import copy_out

    return copy_out(view, dest, ref)
