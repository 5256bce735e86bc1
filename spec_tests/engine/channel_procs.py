"""Spawn-process helpers for the tensor channel tests (top-level, so spawn can import them).

Each child runs :func:`serve`: it receives ``(function name, args, kwargs)``
over its pipe, runs that function of this module and answers ``("ok", result)``
or ``("err", exception type name, message)``. Channels are adopted once per
child (:func:`adopt`) so that the producer's pools persist between calls.
Tensors never cross the pipes: the producer builds them from a spec
(:func:`make`) and consumers answer digests (:func:`digest`).
"""

from __future__ import annotations

import hashlib
import time
import traceback
from typing import Any

import torch

from engine.tensor_channel import WorkerTensorChannel

_CHANNELS: dict[str, WorkerTensorChannel] = {}


def make(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    """A deterministic tensor: the parent builds the same one to compute expected digests."""
    dt = getattr(torch, dtype.removeprefix("torch."))
    g = torch.Generator().manual_seed(seed)
    if dt.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dt)
    if dt == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int64).to(dt)


def digest(t: torch.Tensor) -> tuple:
    flat = t.contiguous().reshape(-1)
    data = flat.view(torch.uint8) if flat.numel() else flat
    return tuple(t.shape), str(t.dtype), hashlib.sha1(data.numpy().tobytes()).hexdigest()


def build(spec: Any) -> Any:
    """Replace ("T", shape, dtype, seed) leaves by tensors; ("same", key) reuses one object."""
    made: dict[Any, torch.Tensor] = {}

    def walk(x: Any) -> Any:
        if isinstance(x, tuple) and x and x[0] == "T":
            key = x[1:]
            if key not in made:
                made[key] = make(*key)
            return made[key]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(spec)


def summarize(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("digest", *digest(x))
    if isinstance(x, dict):
        return {k: summarize(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(summarize(v) for v in x)
    return x


# -- commands ------------------------------------------------------------------


def adopt(channel: WorkerTensorChannel) -> str:
    _CHANNELS[channel.channel_id] = channel
    return channel.channel_id


def send(cid: str, spec: Any, device: str = "cpu") -> Any:
    tree = build(spec)
    if device != "cpu":
        moved: dict[int, torch.Tensor] = {}
        tree = _map_tensors(tree, lambda t: moved.setdefault(id(t), t.to(device)))
    return _CHANNELS[cid].send(tree)


def _map_tensors(x: Any, fn: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(v, fn) for v in x)
    return x


def timed_send(cid: str, spec: Any, device: str = "cpu") -> tuple[float, Any]:
    start = time.monotonic()
    try:
        refs = send(cid, spec, device)
        return time.monotonic() - start, refs
    except Exception as exc:  # noqa: BLE001 - relayed to the test
        return time.monotonic() - start, (type(exc).__name__, str(exc))


def receive(cid: str, refs: Any, rank: int, device: str | None = None) -> Any:
    got = _CHANNELS[cid].receive(refs, rank=rank, device=device)
    devices = {str(t.device) for t in _leaves(got)}
    return summarize(_map_tensors(got, lambda t: t.cpu())), devices


def _leaves(x: Any) -> list:
    out: list = []
    _map_tensors(x, out.append)
    return out


_VIEWS: dict[tuple[str, int], list[Any]] = {}  # zero-copy receives held per (channel, rank)


def receive_view(cid: str, refs: Any, rank: int) -> Any:
    """Zero-copy receive; the views stay alive here until :func:`release`. Answers their digest."""
    got = _CHANNELS[cid].receive(refs, rank=rank, copy=False)
    _VIEWS.setdefault((cid, rank), []).append(got)
    return summarize(got)


def held_views(cid: str, rank: int) -> Any:
    """Digests of the views this rank still holds (they must not have changed)."""
    return [summarize(v) for v in _VIEWS.get((cid, rank), [])]


def release(cid: str, refs: Any, rank: int) -> None:
    _VIEWS.pop((cid, rank), None)
    _CHANNELS[cid].release(refs, rank=rank)


def identity_check(cid: str, refs: Any, rank: int) -> bool:
    """True when duplicate refs come back as one tensor object."""
    got = _CHANNELS[cid].receive(refs, rank=rank)
    return got[0] is got[1]


def discard(cid: str, refs: Any, rank: int | None, sync: bool) -> None:
    _CHANNELS[cid].discard(refs, rank=rank, sync=sync)


def detach(cid: str) -> None:
    for key in [k for k in _VIEWS if k[0] == cid]:
        del _VIEWS[key]
    _CHANNELS.pop(cid).detach()


def serve(conn: Any) -> None:
    torch.set_num_threads(1)
    try:
        while True:
            message = conn.recv()
            if message is None:
                break
            name, args, kwargs = message
            try:
                reply = ("ok", globals()[name](*args, **kwargs))
            except Exception as exc:  # noqa: BLE001 - relayed to the test
                reply = ("err", type(exc).__name__, f"{exc}\n{traceback.format_exc()}")
            conn.send(reply)
    finally:
        for channel in _CHANNELS.values():
            channel.detach()
        conn.close()
