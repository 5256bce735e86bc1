"""The consumer side of :class:`~engine.tensor_channel.WorkerTensorChannel` (a mixin).

``receive`` (copying, or zero-copy views held until ``release``), ``release``,
``discard``, the producer-order rule and the metadata checks. The protocol is
described in :mod:`engine.tensor_channel`; the channel supplies the control
words, the layout, the ack helpers and its CPU pool's segments (see the class).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .errors import shown
from .tensor_channel_refs import (
    TensorChannelDiscarded,
    TensorChannelError,
    TensorChannelMismatch,
    TensorChannelOrderError,
    WorkerTensorRef,
)
from .tensor_channel_shm import DTYPES, CpuPayload, Segment, read_header, slot_view
from .tensor_tree import leaves_of, map_leaves

__all__ = ["ConsumerSide", "copy_out"]


class ConsumerSide:
    """Consumer methods of the channel (mixed into WorkerTensorChannel).

    It owns the consumer's local state (attached segments, each rank's receive order, the CUDA consumer)
    and uses the channel only through its public members: ``world_size``, ``channel_id``, ``timeout``,
    ``prefix``, ``layout``, ``control_words()``, ``own_segment()``, ``resolved()``, ``held()`` and
    ``wait_resolved()``.
    """

    def __init__(self) -> None:
        self._attached: dict[str, Segment] = {}
        self._through: dict[int, int] = {}
        self._cuda_consumer = None

    def detach(self) -> None:
        """Drop the consumer's mappings in this process."""
        if self._cuda_consumer is not None:
            self._cuda_consumer.close()
        self._cuda_consumer = None
        for segment in self._attached.values():
            segment.close()
        self._attached.clear()

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:  # True is no 1
            raise ValueError(f"rank must be in [0, {self.world_size}), got {shown(rank)}")

    def _own_refs(self, tree: Any) -> dict[int, list[WorkerTensorRef]]:
        by_tid: dict[int, dict[int, WorkerTensorRef]] = {}
        for ref in leaves_of(tree, WorkerTensorRef):
            if ref.channel_id == self.channel_id:
                by_tid.setdefault(ref.transfer_id, {})[ref.tensor_index] = ref
        return {tid: [refs[i] for i in sorted(refs)] for tid, refs in sorted(by_tid.items())}

    def receive(
        self, tree: Any, *, rank: int = 0, device: torch.device | str | None = None, out: Any = None, copy: bool = True
    ) -> Any:
        """Replace this channel's refs in ``tree`` by tensors (this rank's shard).

        Refs of other channels and non-ref leaves pass through untouched. Every
        tensor of a transfer must be received in the same call. ``out``: a tensor,
        or one per distinct ref in tree order, to copy into instead of allocating
        (it must have the rank-local shape and the dtype; its device is used).

        ``copy=True`` (default): the tensors are copies and every transfer is acked
        at once. ``copy=False``: CPU tensors are read-only views of the slots (see
        the module docs), and the rank *holds* every transfer until
        :meth:`release` (no ``out`` then).
        """
        self._check_rank(rank)
        if not copy and out is not None:
            raise ValueError("out= needs copy=True (a zero-copy receive returns views of the slots)")
        got: dict[tuple[int, int], torch.Tensor] = {}
        dest: dict[tuple[int, int], torch.Tensor] = {}
        if out is not None:
            keys = list(dict.fromkeys((r.transfer_id, r.tensor_index) for r in leaves_of(tree, WorkerTensorRef)
                                      if r.channel_id == self.channel_id))
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            if len(outs) != len(keys):
                raise ValueError(f"out has {len(outs)} tensors for {len(keys)} refs")
            dest = dict(zip(keys, outs))
            self._check_outs(tree, dest, rank)  # all of them before any transfer is taken (and acked)
        for tid, refs in self._own_refs(tree).items():
            count = _count(refs[0])
            if [r.tensor_index for r in refs] != list(range(count)):
                raise ValueError(f"transfer {tid}: receive all {count} tensors of a transfer together")
            self._check_order(rank, tid)
            if self.resolved(rank, tid) or self.held(rank, tid):
                raise TensorChannelDiscarded(f"{self!r}: transfer {tid} was already discarded or received on rank {rank}")
            checks: list[Callable[[], None]] = []
            for ref in refs:
                key = (tid, ref.tensor_index)
                got[key] = self._receive_one(ref, rank, device, checks, dest.get(key), copy)
            words = self.control_words()
            if not copy:
                words[self.layout.hold(rank, tid)] = tid  # a discard from now on leaves the slot alone
            try:
                for check in checks:
                    check()
                if not copy and self.resolved(rank, tid):
                    raise TensorChannelDiscarded(f"{self!r}: transfer {tid} was discarded while rank {rank} received it")
            except TensorChannelDiscarded:
                if not copy:
                    words[self.layout.hold(rank, tid)] = 0
                raise
            index = self.layout.ack(rank, tid)
            if copy and abs(words[index]) < tid:
                words[index] = tid
            self._advance(rank, tid)
        return map_leaves(
            tree, lambda r: got.get((r.transfer_id, r.tensor_index), r) if r.channel_id == self.channel_id else r, WorkerTensorRef
        )

    def release(self, tree: Any, *, rank: int = 0) -> None:
        """End a zero-copy receive: ack every transfer of ``tree`` that ``rank`` holds (its slots may be reused).

        Raises :class:`TensorChannelError` (changing nothing) for a ref of another
        channel, or a transfer the rank does not hold (released already, received
        with ``copy=True``, or never received).
        """
        self._check_rank(rank)
        foreign = sorted({r.channel_id for r in leaves_of(tree, WorkerTensorRef) if r.channel_id != self.channel_id})
        if foreign:
            raise TensorChannelError(f"{self!r}: cannot release refs of other channels {foreign}")
        tids = list(self._own_refs(tree))
        for tid in tids:
            if not self.held(rank, tid):
                raise TensorChannelError(
                    f"{self!r}: rank {rank} does not hold transfer {tid} (released already, received with "
                    "copy=True, discarded or never received)"
                )
        words = self.control_words()
        for tid in tids:
            index = self.layout.ack(rank, tid)
            if abs(words[index]) < tid:
                words[index] = tid
            words[self.layout.hold(rank, tid)] = 0

    def _check_order(self, rank: int, tid: int) -> None:
        words = self.control_words()
        through_index = self.layout.through(rank)
        t = max(self._through.get(rank, 0), words[through_index])
        while t + 1 < tid and (self.resolved(rank, t + 1) or self.held(rank, t + 1)):
            t += 1
        self._through[rank] = t
        words[through_index] = max(words[through_index], t)
        if t + 1 < tid:
            raise TensorChannelOrderError(
                f"{self!r}: rank {rank} received transfer {tid} before transfer {t + 1} was received or discarded; "
                "consumers must resolve transfers in producer order"
            )

    def _advance(self, rank: int, tid: int) -> None:
        if self._through.get(rank, 0) == tid - 1:
            self._through[rank] = tid
            self.control_words()[self.layout.through(rank)] = tid

    def mismatch(self, ref: WorkerTensorRef, rank: int, field: str, expected: Any, got: Any) -> TensorChannelMismatch:
        return TensorChannelMismatch(
            f"{self!r} rank {rank} received incompatible tensor metadata for transfer {ref.transfer_id} "
            f"tensor {ref.tensor_index}: {field} expected {expected!r}, got {got!r}"
        )

    def validate(self, ref: WorkerTensorRef, rank: int, shape: tuple, dtype: str, nbytes: int, device: str | None) -> None:
        """Raise TensorChannelMismatch unless the slot's metadata matches the ref (used by both paths)."""
        for field, expected, got in (
            ("shape", ref.shape, tuple(shape)), ("dtype", ref.dtype, dtype), ("nbytes", ref.nbytes, nbytes),
            ("device", ref.source_device, device),
        ):
            if got is not None and expected != got:
                raise self.mismatch(ref, rank, field, expected, got)

    def _check_outs(self, tree: Any, dest: dict[tuple[int, int], Any], rank: int) -> None:
        """Each ``out`` tensor has its ref's rank-local shape and dtype: a wrong one found on the way left the
        transfers before it received and acked, their data gone for a retry."""
        for ref in leaves_of(tree, WorkerTensorRef):
            given = dest.get((ref.transfer_id, ref.tensor_index))
            if given is None or ref.channel_id != self.channel_id:
                continue
            shape = self._local_shape(ref, rank)
            if not isinstance(given, torch.Tensor) or tuple(given.shape) != shape or str(given.dtype) != ref.dtype:
                got = f"{tuple(given.shape)} {given.dtype}" if isinstance(given, torch.Tensor) else type(given).__name__
                raise ValueError(f"out for transfer {ref.transfer_id} tensor {ref.tensor_index} must be {shape} "
                                 f"{ref.dtype}, got {got}")

    def _local_shape(self, ref: WorkerTensorRef, rank: int) -> tuple[int, ...]:
        """The shape of ``rank``'s part of the ref's tensor (all of it without sharding)."""
        if ref.shard_dim is None or not 0 <= ref.shard_dim < len(ref.shape):
            return tuple(ref.shape)
        expected = list(ref.shape)
        expected[ref.shard_dim] = len(range(ref.shape[ref.shard_dim])[rank :: self.world_size])  # same count as split
        return tuple(expected)

    def local_view(self, ref: WorkerTensorRef, rank: int, full: torch.Tensor) -> torch.Tensor:
        """The rank's slice of ``full`` (all of it without sharding), checked against the ref."""
        if ref.shard_dim is None:
            return full
        if not 0 <= ref.shard_dim < len(ref.shape) or ref.shape[ref.shard_dim] < self.world_size:
            raise self.mismatch(ref, rank, "shard_dim", "a dim with size >= world size", ref.shard_dim)
        view = torch.tensor_split(full, self.world_size, ref.shard_dim)[rank]
        expected = self._local_shape(ref, rank)
        nbytes = view.numel() * view.element_size()
        if tuple(view.shape) != tuple(expected) or nbytes != ref.nbytes // max(ref.shape[ref.shard_dim], 1) * expected[ref.shard_dim]:
            raise self.mismatch(ref, rank, "shard shape", tuple(expected), tuple(view.shape))
        return view

    def _receive_one(self, ref: WorkerTensorRef, rank: int, device: Any, checks: list, dest: Any, copy: bool) -> torch.Tensor:
        payload = ref.payload
        if not isinstance(payload, CpuPayload):
            if self._cuda_consumer is None:
                from .tensor_channel_cuda import CudaConsumer

                self._cuda_consumer = CudaConsumer(self)
            return self._cuda_consumer.receive(ref, rank, device, dest)
        segment = self._attach(payload)
        header = read_header(segment)
        seq = segment.words[0]
        if seq != ref.transfer_id:
            if self.resolved(rank, ref.transfer_id) or seq == 0 or seq > ref.transfer_id:
                raise TensorChannelDiscarded(f"{self!r}: transfer {ref.transfer_id} was released before rank {rank} received it")
            raise self.mismatch(ref, rank, "transfer_id", ref.transfer_id, seq)
        if header is None:
            raise self.mismatch(ref, rank, "header", "a valid slot header", list(segment.words[:5]))
        _, nbytes, code, shape = header
        dtype = DTYPES[code]
        self.validate(ref, rank, shape, str(dtype), nbytes, "cpu")
        view = self.local_view(ref, rank, slot_view(segment, dtype, shape, nbytes))
        if copy or dest is not None:
            out = copy_out(view, dest, ref)
        elif device is not None and torch.device(device) != view.device:
            out = view.to(device, copy=True)
        else:
            out = view

        def check() -> None:
            if segment.words[0] != ref.transfer_id:
                raise TensorChannelDiscarded(f"{self!r}: transfer {ref.transfer_id} was released while rank {rank} copied it")

        checks.append(check)
        return out if device is None or dest is not None or not copy else out.to(device)

    def _attach(self, payload: CpuPayload) -> Segment:
        segment = self._attached.get(payload.name)
        if segment is None:
            for name, old in list(self._attached.items()):  # an evicted epoch of the same profile entry
                if name.startswith(f"{self.prefix}p{payload.entry}e") and old.epoch != payload.epoch:
                    old.close()
                    del self._attached[name]
            own = self.own_segment(payload.name)
            try:
                segment = own if own is not None else Segment(payload.name)
            except FileNotFoundError as exc:
                raise TensorChannelError(
                    f"{self!r}: the segment of transfer slot {payload.name} is gone (the channel was closed)"
                ) from exc
            segment.epoch = payload.epoch
            if own is None:
                self._attached[payload.name] = segment
        return segment

    def discard(self, tree: Any, *, rank: int | None = None, sync: bool = True) -> None:
        """Release this channel's transfers in ``tree`` for ``rank`` (every rank when None).

        A rank holding a zero-copy view of a transfer keeps it until it releases
        it. With ``sync`` waits (bounded by ``timeout``) until every consumer rank
        has resolved them, i.e. their slots are free for the producer.
        """
        self.discard_transfers(list(self._own_refs(tree)), rank=rank, sync=sync)

    def discard_transfers(self, tids: Iterable[int], *, rank: int | None = None, sync: bool = True) -> None:
        """:meth:`discard` by transfer id (the refs themselves may be gone: a value that did not load)."""
        ranks = range(self.world_size) if rank is None else [rank]
        if rank is not None:
            self._check_rank(rank)
        tids = list(tids)
        words = self.control_words()
        for tid in tids:
            for r in ranks:
                index = self.layout.ack(r, tid)
                if abs(words[index]) < tid and not self.held(r, tid):
                    words[index] = -tid
        if sync:
            self.wait_resolved(tids, "discard", time.monotonic() + self.timeout)


def copy_out(view: torch.Tensor, dest: torch.Tensor | None, ref: WorkerTensorRef) -> torch.Tensor:
    """A contiguous copy of ``view``: into ``dest`` when given (checked), else a new tensor."""
    if dest is None:
        return view.clone(memory_format=torch.contiguous_format)
    if dest.shape != view.shape or dest.dtype != view.dtype:
        raise ValueError(
            f"out for transfer {ref.transfer_id} tensor {ref.tensor_index} must be {tuple(view.shape)} {view.dtype}, "
            f"got {tuple(dest.shape)} {dest.dtype}"
        )
    return dest.copy_(view)


def _count(ref: WorkerTensorRef) -> int:
    count = getattr(ref.payload, "count", None)
    if not isinstance(count, int) or count < 1:
        raise TensorChannelMismatch(f"ref {ref!r} carries no channel payload (was it rebuilt without one?)")
    return count
