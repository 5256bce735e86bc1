"""The tensor channel's references and errors (what the scheduler process sees of it)."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import attrs

from .errors import EngineError, FatalStageError

__all__ = [
    "TensorChannelDiscarded",
    "TensorChannelError",
    "TensorChannelMismatch",
    "TensorChannelOrderError",
    "TensorChannelTimeout",
    "WorkerTensorRef",
    "discard_lost_transfers",
    "discard_sent",
    "note_sent",
    "register_owner",
    "transfers_sent",
    "unlink_every_owned_segment",
]


class TensorChannelError(EngineError, RuntimeError):
    """Base of the tensor channel's errors (also: a bad release)."""


class TensorChannelMismatch(TensorChannelError):
    """A reference does not describe the tensor its slot holds (names field, expected, got)."""


class TensorChannelTimeout(TensorChannelError, FatalStageError):
    """A slot or a sync discard was not released in time; the worker must be failed, not reused."""


class TensorChannelOrderError(TensorChannelError):
    """A consumer rank resolved a transfer before an earlier one (receive in producer order)."""


class TensorChannelDiscarded(TensorChannelError):
    """The transfer was already discarded (or received) on this rank; its slot may be reused."""


@attrs.frozen
class WorkerTensorRef:
    """What the scheduler holds instead of a tensor. Equality, hash and repr ignore the payload."""

    channel_id: str
    transfer_id: int
    tensor_index: int
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: str
    nbytes: int
    source_device: str
    shard_dim: int | None = None
    payload: Any = attrs.field(default=None, eq=False, hash=False, repr=False)


class _OwnedChannel(Protocol):
    channel_id: str
    closed: bool

    def discard_transfers(self, tids: Iterable[int], *, rank: int | None = None, sync: bool = True) -> None: ...

    def unlink_segments(self) -> None: ...


#: the channels this process created (their owner: the scheduler), by id, for :func:`discard_lost_transfers`
_OWNED: weakref.WeakValueDictionary[str, _OwnedChannel] = weakref.WeakValueDictionary()


def register_owner(channel: _OwnedChannel) -> None:
    """``channel`` was created in this process: refs of it that are lost here can be discarded here."""
    _OWNED[channel.channel_id] = channel


def unlink_every_owned_segment() -> None:
    """Unlink the shared memory of every channel this process created, now: for a process about to end with
    ``os._exit`` (a second signal), which runs no finalizer. Its segments stayed in /dev/shm for good, 6 for an
    aborted ``chunkline run`` and some 70 for a server, and nothing removed them later."""
    for channel in list(_OWNED.values()):
        channel.unlink_segments()


#: per thread, the lists open (:func:`transfers_sent`) that each transfer a channel sends is noted in
_sent_lists = threading.local()


@contextlib.contextmanager
def transfers_sent() -> Iterator[list[tuple[_OwnedChannel, int]]]:
    """The transfers this thread's channels send while it is open, ``(channel, transfer id)``: a worker rank's call
    that fails after sending (its value, which holds the refs, never leaves the rank) discards them
    (:func:`discard_sent`); they had no refs anywhere, and every later receive of their channels failed, out of order."""
    sent: list[tuple[_OwnedChannel, int]] = []
    lists = _sent_lists.__dict__.setdefault("open", [])
    lists.append(sent)
    try:
        yield sent
    finally:
        lists.remove(sent)


def note_sent(channel: _OwnedChannel, tid: int) -> None:
    """A channel sent transfer ``tid`` from this thread (for every :func:`transfers_sent` open in it)."""
    for sent in getattr(_sent_lists, "open", ()):
        sent.append((channel, tid))


def discard_sent(sent: Iterable[tuple[_OwnedChannel, int]]) -> None:
    """Discard, for every consumer rank, transfers whose refs never left this process (a channel closed since is left
    alone: its slots went with it)."""
    for channel, tid in sent:
        if not channel.closed:
            with contextlib.suppress(TensorChannelError):  # closed meanwhile, by its owner
                channel.discard_transfers([tid], sync=False)


def discard_lost_transfers(transfers: Iterable[tuple[str, int]]) -> None:
    """Discard, for every consumer rank, the transfers (``(channel id, transfer id)``) of refs that were lost on
    their way to the scheduler -- in a value that did not load in this process, or that a call failing on another
    rank dropped -- so that their slots are free for the producer's next send (else it waits until its timeout).
    Transfers of channels this process did not create, or has closed, are left alone."""
    by_channel: dict[str, set[int]] = {}
    for channel_id, tid in transfers:
        by_channel.setdefault(channel_id, set()).add(tid)
    for channel_id, tids in by_channel.items():
        channel = _OWNED.get(channel_id)
        if channel is not None and not channel.closed:
            channel.discard_transfers(sorted(tids), sync=False)
