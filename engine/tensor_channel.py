"""WorkerTensorChannel: one producer group to one consumer group on the same host.

A tensor artifact (the latent from denoise to decode) never passes through the
scheduler's process: the producer worker ``send``\\s its tensors and hands the
scheduler only :class:`WorkerTensorRef` objects (a few hundred bytes), which the
scheduler forwards to the consumer ranks, which ``receive`` them.

Ownership and lifecycle
-----------------------
* The **parent** (the scheduler) creates the channel. It owns one small *control*
  segment (created at construction; layout in
  :class:`~engine.tensor_channel_shm.ControlLayout`): the producer pid, the last
  transfer id, the epoch of each CPU pool profile and, per consumer rank, a ring
  of ``ACK_WINDOW`` signed acks (``+k``: rank copied or released transfer ``k``;
  ``-k``: rank discarded it) and a ring of holds (``k``: the rank holds a
  zero-copy view of transfer ``k``). The parent owns every shared-memory name of
  the channel: ``close()`` (exactly once, idempotent; also run by a finalizer at
  interpreter exit) unlinks the control segment and every data segment
  registered in it.
* The **producer** (exactly one process; the first one that sends claims the
  channel) creates one data segment per slot of a CPU profile -- 2 round-robin
  slots per (tensor index, shape, dtype) -- the first time it sees that profile,
  after registering its epoch in the control segment, so the parent can unlink
  it. Nothing is created, mapped or pickled per transfer. At most
  ``MAX_PROFILES`` CPU profiles are pooled; a new one evicts the least recently
  used profile (waiting, bounded, until its slots are released), and the
  producer unlinks the evicted segments. So one send carries at most
  ``MAX_PROFILES`` CPU tensors (and as many CUDA ones): more is a ValueError.
* **Consumers** attach to segments by name (once) and only detach (``detach()``).
  Nothing here registers with multiprocessing's resource tracker: the segment
  lifetimes are explicit, so children never unlink what the parent owns.

Protocol (CPU)
--------------
A slot starts with a header (seq, transfer id, nbytes, dtype code, shape). The
producer waits until the transfer last held by a slot is resolved (acked,
released or discarded) by *every* consumer rank -- bounded by ``timeout``, else
:class:`TensorChannelTimeout`, which is a :class:`~engine.errors.FatalStageError`
(the worker is failed, never left hanging) -- then sets seq to 0, copies the
tensor and sets seq to the transfer id. A consumer checks the seq before and
after using its view (a seqlock: a slot released under it by a concurrent
discard is detected), then writes its ack. Cross-process ordering of these
plain stores relies on a total-store-order host (x86-64).

Zero-copy receive
-----------------
``receive(refs, rank=r, copy=False)`` returns tensors that are **views of the
slot's shared memory** (for CPU refs received on the CPU; a device move or a
CUDA ref still copies). They are **read-only by contract** -- writing into them
changes what the other consumer ranks see -- and valid until the consumer calls
``release(refs, rank=r)``, which acks the transfer so the producer may reuse the
slot. Until then the rank *holds* the transfer: the producer's next send into
that slot waits (bounded by ``timeout``), and ``discard`` does not free it (a
sync discard waits for the release). Releasing twice, releasing a transfer the
rank does not hold, or releasing a ref of another channel raises
:class:`TensorChannelError`. Drop the tensors before releasing: after the
release the producer overwrites the memory they show.

Consumers resolve **in producer order**: a rank receiving transfer ``k`` while an
earlier transfer is neither received nor discarded on that rank raises
:class:`TensorChannelOrderError` at once (waiting could deadlock a
single-threaded worker; the out-of-order call is a caller bug). A held transfer
counts as received. Discards may come in any order, from any process (the
scheduler discards a cancelled artifact for every rank with ``discard(refs)``).

CUDA tensors go through :mod:`engine.tensor_channel_cuda` (IPC-handle pools with
interprocess ready/done events); the acks and ordering rules are the same.
"""

from __future__ import annotations

import os
import secrets
import time
import weakref
from collections.abc import Iterable
from typing import Any, Self

import torch

from .errors import error_text, integer, seconds
from .tensor_channel_consumer import ConsumerSide
from .tensor_channel_refs import (
    TensorChannelDiscarded,
    TensorChannelError,
    TensorChannelMismatch,
    TensorChannelOrderError,
    TensorChannelTimeout,
    WorkerTensorRef,
    note_sent,
    register_owner,
)
from .tensor_channel_shm import (
    ACK_WINDOW,
    CPU_SLOTS,
    DTYPE_CODE,
    MAGIC,
    MAX_NDIM,
    MAX_PROFILES,
    ControlLayout,
    CpuSlotPool,
    Segment,
    SHARED_MEMORY,
    release_owned,
)
from .shm_names import channel_owner, remove_stale_segments, segment_prefix
from .tensor_tree import hidden_tensor_holder, map_leaves, unique_tensors

SPIN_S = 0.002  # a waiting producer yields its core this long before sleeping (slot waits are usually short)
#: consumer ranks of one channel at most (its control segment grows with them: a billion asked for /dev/shm's all)
MAX_CONSUMERS = 1024

__all__ = [
    "ACK_WINDOW",
    "CPU_SLOTS",
    "MAX_PROFILES",
    "TensorChannelDiscarded",
    "TensorChannelError",
    "TensorChannelMismatch",
    "TensorChannelOrderError",
    "TensorChannelTimeout",
    "WorkerTensorChannel",
    "WorkerTensorRef",
]


class WorkerTensorChannel(ConsumerSide):
    """Created in the parent; pickle it to the producer and consumer processes (spawn)."""

    def __init__(
        self, consumer_world_size: int = 1, *, timeout: float = 600.0, shard_dim: int | None = None, cuda_ipc_slots: int = 2
    ) -> None:
        consumer_world_size = integer("consumer_world_size", consumer_world_size, minimum=1, maximum=MAX_CONSUMERS)
        seconds("timeout", timeout, finite=True)  # every wait of a transfer is bounded by it: none is left hanging
        # a slot past the transfers that can be in flight at once would never be used
        cuda_ipc_slots = integer("cuda_ipc_slots", cuda_ipc_slots, minimum=1, maximum=ACK_WINDOW)
        if shard_dim is not None:
            shard_dim = integer("shard_dim", shard_dim, minimum=-MAX_NDIM, maximum=MAX_NDIM - 1)
        if not SHARED_MEMORY:  # pragma: no cover
            raise RuntimeError("WorkerTensorChannel needs POSIX shared memory")
        remove_stale_segments()  # what processes killed before they could unlink left in /dev/shm
        self.channel_id = f"{channel_owner()}-{secrets.token_hex(5)}"  # a later process can tell it is stale
        self.world_size = consumer_world_size
        self.timeout = float(timeout)
        self.shard_dim = shard_dim
        self.cuda_ipc_slots = cuda_ipc_slots
        self._init_local()
        self._control = Segment(self.prefix + "ctl", self.layout.words * 8, create=True)
        self._control.words[ControlLayout.MAGIC] = MAGIC
        self._owner_state = {"closed": False}
        self._finalizer = weakref.finalize(self, release_owned, self._control, self.prefix, self._owner_state)
        register_owner(self)  # a ref of it lost in this process (a value that does not load) is discarded here

    def _init_local(self) -> None:
        self.prefix = segment_prefix(self.channel_id)
        self.layout = ControlLayout(self.world_size)
        self._control: Segment | None = None
        self._finalizer = None
        self._pool = CpuSlotPool(self.prefix, self.control_words)
        self._cuda_producer = None
        self._detached = False
        ConsumerSide.__init__(self)  # the consumer's own state in this process

    def __getstate__(self) -> dict:
        return {k: getattr(self, k) for k in ("channel_id", "world_size", "timeout", "shard_dim", "cuda_ipc_slots")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_local()

    def __repr__(self) -> str:
        return f"WorkerTensorChannel({self.channel_id}, consumers={self.world_size}, shard_dim={self.shard_dim})"

    # -- lifecycle -------------------------------------------------------------------

    @property
    def is_owner(self) -> bool:
        return self._finalizer is not None

    @property
    def closed(self) -> bool:
        return self._detached or (self.is_owner and not self._finalizer.alive)

    def detach(self) -> None:
        """Drop this process's mappings and CUDA pools (children call this when they stop)."""
        self._detached = True
        if self._cuda_producer is not None:
            self._cuda_producer.close()
        self._cuda_producer = None
        super().detach()
        self._pool.close()
        if self._control is not None and not self.is_owner:
            self._control.close()
            self._control = None

    def unlink_segments(self) -> None:
        """In the parent: unlink every segment of the channel now, without detaching first (the process is about
        to end at once; its mappings go with it). Idempotent; elsewhere nothing."""
        if self._finalizer is not None:
            self._finalizer()

    def close(self) -> None:
        """In the parent: detach and unlink every segment of the channel (idempotent). Elsewhere: detach."""
        self.detach()
        if self.is_owner:
            self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def control_words(self):
        """The shared control words (mapped on first use in this process)."""
        if self.closed:
            raise TensorChannelError(f"{self!r} is closed")
        if self._control is None:
            try:
                self._control = Segment(self.prefix + "ctl")
            except FileNotFoundError as exc:
                raise TensorChannelError(f"{self!r} is closed (its owner unlinked it)") from exc
        words = self._control.words
        if words[ControlLayout.MAGIC] != MAGIC:  # the owner closed it after this process mapped it
            raise TensorChannelError(f"{self!r} is closed (by its owner)")
        return words

    # -- acks ------------------------------------------------------------------------

    def own_segment(self, name: str) -> Segment | None:
        """The CPU pool's segment ``name`` when this process created it (the producer's own mapping)."""
        return self._pool.segment(name)

    def ack_of(self, rank: int, tid: int) -> int:
        """+tid: rank copied (or released) transfer tid; -tid: discarded; 0: unresolved (a newer ack also means resolved)."""
        value = self.control_words()[self.layout.ack(rank, tid)]
        return value if abs(value) == tid else (tid if abs(value) > tid else 0)

    def resolved(self, rank: int, tid: int) -> bool:
        """Whether ``rank`` acked or discarded transfer ``tid`` (so its slot is free of that rank)."""
        return tid <= 0 or abs(self.control_words()[self.layout.ack(rank, tid)]) >= tid

    def held(self, rank: int, tid: int) -> bool:
        """Whether ``rank`` holds zero-copy views of transfer ``tid`` (until it releases them)."""
        return tid > 0 and self.control_words()[self.layout.hold(rank, tid)] == tid

    def wait_resolved(self, tids: Iterable[int], what: str, deadline: float) -> None:
        """Until every rank resolved every transfer of ``tids``; :class:`TensorChannelTimeout` at ``deadline``."""
        tids = [t for t in tids if t > 0]
        if not tids:
            return
        spin_until, delay = time.monotonic() + SPIN_S, 0.00005
        while True:
            pending = sorted({r for r in range(self.world_size) for t in tids if not self.resolved(r, t)})
            if not pending:
                return
            if time.monotonic() >= deadline:
                held = sorted({r for r in pending for t in tids if self.held(r, t)})
                raise TensorChannelTimeout(
                    f"{self!r}: {what}: transfers {sorted(tids)} not released by consumer ranks {pending} "
                    f"within {self.timeout:g} s" + (f" (ranks {held} hold zero-copy views)" if held else "")
                    + "; the worker must be failed"
                )
            if time.monotonic() < spin_until:  # a consumer is usually mid-copy: yield first, then back off (<= 1 ms)
                os.sched_yield()
            else:
                time.sleep(delay)
                delay = min(delay * 2, 0.001)

    # -- producer --------------------------------------------------------------------

    def send(self, tree: Any) -> Any:
        """Copy every tensor in ``tree`` into the channel; return ``tree`` with WorkerTensorRefs instead."""
        holder = hidden_tensor_holder(tree)
        if holder is not None:
            raise ValueError(f"tree: a {holder} in it holds tensors, which the channel does not reach (it sends those "
                             f"in dicts, lists and tuples): hold them in those")
        leaves, seen = unique_tensors(tree)
        if not leaves:
            return tree
        dims = [self._check_leaf(i, t) for i, t in enumerate(leaves)]
        _check_rebuilt(tree)
        # each tensor of a transfer needs a pooled profile of its own: with more than the pool holds, the send would
        # wait to evict a profile this same transfer filled (until its timeout, 600 s by default)
        on_cuda = sum(1 for t in leaves if t.is_cuda)
        if max(on_cuda, len(leaves) - on_cuda) > MAX_PROFILES:
            raise ValueError(
                f"tensors: one send carries at most {MAX_PROFILES} CPU and {MAX_PROFILES} CUDA tensors, got "
                f"{len(leaves) - on_cuda} and {on_cuda}; send fewer, larger ones (stack them) or use several sends"
            )
        words = self.control_words()
        pid = os.getpid()
        if words[ControlLayout.PRODUCER] not in (0, pid):
            raise TensorChannelError(
                f"{self!r} already has a producer (pid {words[ControlLayout.PRODUCER]}); one producer per channel"
            )
        words[ControlLayout.PRODUCER] = pid
        tid = words[ControlLayout.LAST_TID] + 1
        deadline = time.monotonic() + self.timeout
        self.wait_resolved([tid - ACK_WINDOW], "ack window full", deadline)
        words[ControlLayout.LAST_TID] = tid
        try:
            refs = [self._send_one(tid, i, t, len(leaves), dims[i], deadline) for i, t in enumerate(leaves)]
        except BaseException:
            # no consumer will ever see this transfer: it is resolved for every rank, so the transfers after it are
            # in order and its slots free (it had no refs, nothing could discard it, and every later receive of the
            # channel failed, out of order, until the producer's sends timed out)
            self.discard_transfers([tid], sync=False)
            raise
        note_sent(self, tid)
        return map_leaves(tree, lambda t: refs[seen[id(t)]], torch.Tensor)

    def _check_leaf(self, index: int, t: torch.Tensor) -> int | None:
        """What could refuse a tensor, checked before the send takes a transfer id: its shard dimension."""
        if t.layout != torch.strided or t.is_nested:
            raise ValueError(f"tensor {index}: only strided tensors can be sent, got "
                             f"{'a nested tensor' if t.is_nested else t.layout}")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"tensor {index}: device {t.device} is not supported (cpu or cuda)")
        if t.dtype not in DTYPE_CODE:
            raise ValueError(f"tensor {index}: dtype {t.dtype} is not supported")
        if t.dim() > MAX_NDIM:
            raise ValueError(f"tensor {index}: at most {MAX_NDIM} dimensions, got {t.dim()}")
        if self.shard_dim is None:
            return None
        if not -t.dim() <= self.shard_dim < t.dim():
            raise ValueError(f"tensor {index}: shard_dim {self.shard_dim} is out of range for shape {tuple(t.shape)}")
        dim = self.shard_dim % t.dim()
        if t.shape[dim] < self.world_size:
            raise ValueError(
                f"tensor {index}: size {t.shape[dim]} along shard_dim {self.shard_dim} is smaller than the "
                f"consumer world size {self.world_size}"
            )
        return dim

    def _send_one(self, tid: int, index: int, t: torch.Tensor, count: int, dim: int | None, deadline: float):
        t = t.detach()
        fields = {
            "channel_id": self.channel_id, "transfer_id": tid, "tensor_index": index, "shape": tuple(t.shape), "dtype": str(t.dtype),
            "nbytes": t.numel() * t.element_size(), "source_device": str(t.device), "shard_dim": dim,
        }
        if t.is_cuda:
            if self._cuda_producer is None:
                from .tensor_channel_cuda import CudaProducer

                self._cuda_producer = CudaProducer(self, MAX_PROFILES)
            payload = self._cuda_producer.send(tid, index, t, count, deadline)
        else:  # the CPU (_check_leaf refused any other device)
            payload = self._pool.write(tid, index, t, count, lambda tids, what: self.wait_resolved(tids, what, deadline))
        return WorkerTensorRef(**fields, payload=payload)


def _check_rebuilt(tree: Any) -> None:
    """Refuse a tree that cannot be made again with refs in place of its tensors (a ``defaultdict``'s type takes no
    items), before the send takes a transfer id."""
    try:
        map_leaves(tree, lambda t: None, torch.Tensor)
    except Exception as exc:
        raise ValueError(f"tree: a container in it cannot be made again with refs in place of its tensors "
                         f"({error_text(exc)}); hold them in dicts, lists and tuples") from exc
