"""The tensor channel's references and errors (what the scheduler process sees of it)."""

from __future__ import annotations

from typing import Any

import attrs

from .errors import EngineError, FatalStageError

__all__ = [
    "TensorChannelDiscarded",
    "TensorChannelError",
    "TensorChannelMismatch",
    "TensorChannelOrderError",
    "TensorChannelTimeout",
    "WorkerTensorRef",
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
