"""WorkerTensorChannel (reference C.4) through real spawn processes.

Three children live for the module: a producer and two consumer ranks
(``channel_procs.serve``). The test process plays the scheduler: it creates and
closes each channel and forwards the refs, which are all it ever holds.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from typing import Any

import attrs
import pytest
import torch

from engine.tensor_channel import (
    MAX_PROFILES,
    TensorChannelDiscarded,
    TensorChannelError,
    TensorChannelTimeout,
    WorkerTensorChannel,
    WorkerTensorRef,
)

from . import channel_procs
from .channel_procs import make, summarize
from .small_dev_shm import with_small_dev_shm


class RemoteError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class Child:
    def __init__(self, ctx: Any, name: str) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=channel_procs.serve, args=(child_conn,), name=name, daemon=True)
        self.process.start()
        child_conn.close()

    def submit(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.conn.send((name, args, kwargs))

    def result(self, timeout: float = 60.0) -> Any:  # a hang bound
        assert self.conn.poll(timeout), "child did not answer"
        reply = self.conn.recv()
        if reply[0] == "err":
            raise RemoteError(reply[1], reply[2])
        return reply[1]

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.submit(name, *args, **kwargs)
        return self.result()

    def stop(self) -> None:
        self.conn.send(None)
        self.process.join(10)
        self.conn.close()
        self.process.close()


# A spawned child imports torch before it answers: seconds, and tens of seconds on a loaded machine. The
# fixture waits for that once (a hang bound), so a slow start never makes a test's first call miss its
# answer (a missed answer would also leave every later reply one call behind).
START_BOUND_S = 180.0


@pytest.fixture(scope="module")
def procs():
    ctx = multiprocessing.get_context("spawn")
    children = {name: Child(ctx, name) for name in ("producer", "c0", "c1")}
    try:
        for child in children.values():
            child.submit("summarize", "started")
            assert child.result(timeout=START_BOUND_S) == "started"
        yield children
    finally:
        for child in children.values():
            child.stop()


def segments(channel: WorkerTensorChannel) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"cl_{channel.channel_id}_")]


@pytest.fixture
def open_channel(procs):
    """Create channels adopted by the producer and ``ranks`` consumers; close them and check /dev/shm."""
    made: list[tuple[WorkerTensorChannel, list[Child]]] = []

    def opener(world_size: int = 1, **kwargs: Any) -> tuple[WorkerTensorChannel, Child, list[Child]]:
        channel = WorkerTensorChannel(world_size, **kwargs)
        users = [procs["producer"], *(procs[f"c{r}"] for r in range(world_size))]
        for child in users:
            child.call("adopt", channel)
        made.append((channel, users))
        return channel, users[0], users[1:]

    yield opener
    for channel, users in made:
        for child in users:
            child.call("detach", channel.channel_id)
        channel.close()
        channel.close()  # idempotent
        assert segments(channel) == []


def expected(spec: Any, rank: int = 0, world: int = 1, dim: int | None = None) -> Any:
    def walk(x: Any) -> Any:
        if isinstance(x, tuple) and x and x[0] == "T":
            t = make(*x[1:])
            if dim is not None:
                t = torch.tensor_split(t, world, dim)[rank]
            return summarize(t)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(spec)


def only_refs(tree: Any) -> list[WorkerTensorRef]:
    out: list[WorkerTensorRef] = []

    def walk(x: Any) -> None:
        assert not isinstance(x, torch.Tensor), "a tensor reached the scheduler"
        if isinstance(x, WorkerTensorRef):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(tree)
    return out


SPECS = [
    ("T", (2, 3), "float32", 1),
    ("T", (7,), "bfloat16", 2),
    ("T", (4, 5, 6), "int64", 3),
    ("T", (), "float32", 4),
    ("T", (0, 3), "float32", 5),
    ("T", (3, 1, 2, 2), "bool", 6),
]


def test_round_trip_dtypes_shapes_and_nested_structures(open_channel):
    channel, producer, consumers = open_channel(2, timeout=5)
    for spec in SPECS:
        refs = producer.call("send", channel.channel_id, spec)
        (ref,) = only_refs(refs)
        assert (ref.shape, ref.dtype, ref.source_device) == (spec[1], f"torch.{spec[2]}", "cpu")
        for rank, consumer in enumerate(consumers):
            got, devices = consumer.call("receive", channel.channel_id, refs, rank)
            assert got == expected(spec)
            assert devices == {"cpu"}
    shared = ("T", (3, 4), "float32", 9)
    nested = {"latent": [shared, (("T", (2,), "int64", 10), "meta", 7)], "again": shared, "n": None}
    refs = producer.call("send", channel.channel_id, nested)
    assert refs["n"] is None and refs["latent"][1][1:] == ("meta", 7)
    assert refs["again"] == refs["latent"][0]  # a duplicate leaf is sent once
    assert len({r.tensor_index for r in only_refs(refs)}) == 2
    got, _ = consumers[0].call("receive", channel.channel_id, refs, 0)
    assert got == expected(nested)
    consumers[1].call("discard", channel.channel_id, refs, 1, True)
    refs = producer.call("send", channel.channel_id, [shared, shared])
    consumers[0].call("discard", channel.channel_id, refs, 0, False)
    assert consumers[1].call("identity_check", channel.channel_id, refs, 1)


def test_the_parent_only_holds_small_refs(open_channel):
    channel, producer, (consumer,) = open_channel(1, timeout=5)
    spec = {"latent": ("T", (1024, 1024), "float32", 11)}  # 4 MiB
    refs = producer.call("send", channel.channel_id, spec)
    (ref,) = only_refs(refs)
    assert ref.nbytes == 4 << 20
    size = len(pickle.dumps(refs))
    assert size < 1024, size
    assert "payload" not in repr(ref) and attrs.evolve(ref) == ref and hash(attrs.evolve(ref)) == hash(ref)
    got, _ = consumer.call("receive", channel.channel_id, refs, 0)
    assert got == expected(spec)


def test_shard_dim_gives_each_rank_its_slice(open_channel):
    channel, producer, consumers = open_channel(2, timeout=5, shard_dim=-2)
    for spec in (("T", (2, 5, 3), "float32", 12), ("T", (3, 2, 4), "int64", 13), ("T", (7, 3), "bfloat16", 14)):
        refs = producer.call("send", channel.channel_id, spec)
        assert refs.shard_dim == len(spec[1]) - 2 and refs.shape == spec[1]
        for rank, consumer in enumerate(consumers):
            got, _ = consumer.call("receive", channel.channel_id, refs, rank)
            assert got == expected(spec, rank, 2, -2)
            assert got[1][-2] == len(range(spec[1][-2])[rank::2])


def test_invalid_shard_dim_is_refused_at_send():
    with WorkerTensorChannel(2, shard_dim=1) as channel:
        with pytest.raises(ValueError, match="smaller than the consumer world size"):
            channel.send(torch.zeros(4, 1))
        with pytest.raises(ValueError, match="out of range"):
            channel.send({"a": torch.zeros(4)})
    assert segments(channel) == []
    with pytest.raises(ValueError):
        WorkerTensorChannel(0)


@pytest.mark.parametrize(("field", "value"), [
    ("consumer_world_size", True), ("consumer_world_size", 2.0), ("timeout", True), ("timeout", "5"),
    ("timeout", float("nan")), ("timeout", 0), ("cuda_ipc_slots", True), ("shard_dim", True), ("shard_dim", 1.0),
])
def test_bad_channel_settings_are_a_value_error_naming_the_field(field, value):
    """``True`` was taken as 1 (a consumer world size, a timeout of one second, shard dimension 1), and a timeout
    given as a string was a bare TypeError from the comparison."""
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        WorkerTensorChannel(**{field: value})


def test_metadata_mismatch_raises_a_clear_error(open_channel):
    channel, producer, (consumer,) = open_channel(1, timeout=5)
    refs = producer.call("send", channel.channel_id, ("T", (4, 5), "float32", 15))
    for field, value in (("shape", (5, 4)), ("dtype", "torch.float16"), ("nbytes", 40), ("source_device", "cuda:0")):
        with pytest.raises(RemoteError) as info:
            consumer.call("receive", channel.channel_id, attrs.evolve(refs, **{field: value}), 0)
        assert info.value.kind == "TensorChannelMismatch"
        assert "received incompatible tensor metadata" in info.value.message
        assert f"{field.replace('source_', '')} expected {value!r}" in info.value.message
    with pytest.raises(RemoteError, match="ValueError: rank must be in"):
        consumer.call("receive", channel.channel_id, refs, 1)
    other = WorkerTensorRef("elsewhere", 1, 0, (2,), "torch.float32", 8, "cpu")
    got, _ = consumer.call("receive", channel.channel_id, {"mine": refs, "theirs": other}, 0)
    assert got["theirs"] == other and got["mine"] == expected(("T", (4, 5), "float32", 15))


def test_consumers_resolve_in_producer_order(open_channel):
    channel, producer, (consumer,) = open_channel(1, timeout=5)
    cid = channel.channel_id
    specs = [("T", (8,), "float32", 20 + k) for k in range(4)]
    first, second = (producer.call("send", cid, s) for s in specs[:2])
    with pytest.raises(RemoteError) as info:
        consumer.call("receive", cid, second, 0)
    assert info.value.kind == "TensorChannelOrderError" and "before transfer 1" in info.value.message
    assert consumer.call("receive", cid, first, 0)[0] == expected(specs[0])
    assert consumer.call("receive", cid, second, 0)[0] == expected(specs[1])
    third, fourth = (producer.call("send", cid, s) for s in specs[2:])
    channel.discard(third)  # the scheduler drops a cancelled artifact for every rank
    assert consumer.call("receive", cid, fourth, 0)[0] == expected(specs[3])
    with pytest.raises(RemoteError, match="TensorChannelDiscarded"):
        consumer.call("receive", cid, third, 0)


def test_discard_releases_the_slot_on_every_rank(open_channel):
    timeout = 20.0  # what a send waits for a slot that was not freed: far above the bound below
    channel, producer, consumers = open_channel(2, timeout=timeout)
    cid = channel.channel_id
    specs = [("T", (64, 64), "float32", 30 + k) for k in range(4)]
    one, two = (producer.call("send", cid, s) for s in specs[:2])  # both slots are now held
    channel.discard(one, sync=True)
    elapsed, three = producer.call("timed_send", cid, specs[2])
    freed_at_once = timeout / 4  # a freed slot is taken at once; one still held is waited for until the timeout
    assert elapsed < freed_at_once and isinstance(three, WorkerTensorRef), (elapsed, three)
    consumers[0].call("discard", cid, two, 0, False)  # each rank drops its own share
    consumers[1].call("discard", cid, two, 1, True)  # waits for every rank
    elapsed, four = producer.call("timed_send", cid, specs[3])
    assert elapsed < freed_at_once and isinstance(four, WorkerTensorRef), (elapsed, four)
    for rank, consumer in enumerate(consumers):
        assert consumer.call("receive", cid, [three, four], rank)[0] == [expected(specs[2]), expected(specs[3])]


def test_a_transfer_that_is_never_acked_times_out(open_channel):
    timeout = 0.5
    channel, producer, consumers = open_channel(2, timeout=timeout)
    cid = channel.channel_id
    spec = ("T", (16,), "float32", 40)
    one = producer.call("send", cid, spec)
    producer.call("send", cid, spec)
    consumers[0].call("receive", cid, one, 0)  # rank 1 never acks
    elapsed, error = producer.call("timed_send", cid, spec)
    assert error[0] == "TensorChannelTimeout" and "ranks [1]" in error[1] and "worker must be failed" in error[1]
    # waited its timeout, and no longer: the failure guarded is a send left hanging (the channel's default timeout is
    # 600 s), so 3 s of slack for a loaded host still tells the two apart
    bounded_by = timeout + 3.0
    assert timeout * 0.9 <= elapsed < bounded_by, elapsed
    assert issubclass(TensorChannelTimeout, (TensorChannelError,)) and issubclass(TensorChannelTimeout, RuntimeError)
    start = time.monotonic()
    with pytest.raises(TensorChannelTimeout):
        channel.discard(one, rank=0, sync=True)  # rank 1 still holds it
    assert time.monotonic() - start < bounded_by


def test_profiles_beyond_the_pool_evict_the_oldest(open_channel):
    channel, producer, (consumer,) = open_channel(1, timeout=5)
    cid = channel.channel_id
    for k in range(MAX_PROFILES + 3):
        spec = {"x": ("T", (k + 1, 3), "float32", 50 + k)}
        refs = producer.call("send", cid, spec)
        assert consumer.call("receive", cid, refs, 0)[0] == expected(spec)
        assert len(segments(channel)) <= 2 * MAX_PROFILES + 1
    again = ("T", (1, 3), "float32", 99)  # the first profile was evicted; it comes back
    assert consumer.call("receive", cid, producer.call("send", cid, again), 0)[0] == expected(again)


def test_a_send_of_more_tensors_than_the_pool_holds_is_refused_at_once():
    """Each tensor of a send takes a pooled profile of its own: a ninth waited to evict one its own transfer had
    filled, until the channel's timeout (600 s by default). It is a ValueError before anything is written, and the
    channel goes on (the producer and consumer in one process, as tests may)."""
    with WorkerTensorChannel(1, timeout=60) as channel:
        start = time.monotonic()
        with pytest.raises(ValueError, match=f"at most {MAX_PROFILES} CPU .* got {MAX_PROFILES + 1} and 0"):
            channel.send([torch.full((4,), float(k)) for k in range(MAX_PROFILES + 1)])
        assert time.monotonic() - start < 5
        tensors = [torch.full((4,), float(k)) for k in range(MAX_PROFILES)]
        received = channel.receive(channel.send(tensors), rank=0)
        assert all(torch.equal(a, b) for a, b in zip(tensors, received))


def test_close_unlinks_every_segment_and_refuses_use(open_channel):
    channel, producer, (consumer,) = open_channel(1, timeout=5)
    refs = producer.call("send", channel.channel_id, [("T", (5,), "float32", 60), ("T", (2, 2), "int64", 61)])
    assert len(segments(channel)) == 1 + 2 * 2  # control + two profiles of two slots
    consumer.call("receive", channel.channel_id, refs, 0)
    channel.close()
    assert segments(channel) == []
    with pytest.raises(TensorChannelError, match="closed"):
        channel.discard(refs)


def test_a_producer_or_consumer_still_at_work_after_close_gets_a_typed_error_and_leaks_nothing(open_channel, procs):
    channel, producer, (consumer,) = open_channel(1, timeout=5)
    cid = channel.channel_id
    refs = producer.call("send", cid, ("T", (4,), "float32", 70))
    late = procs["c1"]  # a consumer that maps the channel only after the owner closed it
    late.call("adopt", channel)
    try:
        channel.close()
        # the producer still maps the (unlinked) control segment: a new profile was created there and never
        # unlinked by anyone (it leaked in /dev/shm), and a send into an old one "succeeded"
        with pytest.raises(RemoteError, match="closed") as caught:
            producer.call("send", cid, ("T", (3, 3), "int64", 71))
        assert caught.value.kind == "TensorChannelError"
        with pytest.raises(RemoteError, match="closed") as caught:
            producer.call("send", cid, ("T", (4,), "float32", 72))
        assert caught.value.kind == "TensorChannelError"
        assert segments(channel) == []
        for who in (consumer, late):  # was: a FileNotFoundError from shm_open for the late one
            with pytest.raises(RemoteError, match="closed") as caught:
                who.call("receive", cid, refs, 0)
            assert caught.value.kind == "TensorChannelError"
    finally:
        late.call("detach", cid)
    assert segments(channel) == []


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_round_trip_through_the_ipc_pool_and_fallback(open_channel):
    channel, producer, consumers = open_channel(2, timeout=10)
    cid = channel.channel_id
    for k in range(MAX_PROFILES + 2):  # the last two profiles go through torch.multiprocessing
        for repeat in range(3):  # more transfers than slots: exercises the done events
            spec = {"x": ("T", (k + 2, 4), "bfloat16", 70 + k + repeat)}
            refs = producer.call("send", cid, spec, "cuda")
            assert refs["x"].source_device.startswith("cuda")
            for rank, consumer in enumerate(consumers):
                got, devices = consumer.call("receive", cid, refs, rank, "cuda")
                assert got == expected(spec) and devices == {"cuda:0"}


@cuda
def test_cuda_shards_and_mismatch(open_channel):
    channel, producer, consumers = open_channel(2, timeout=10, shard_dim=0)
    cid = channel.channel_id
    spec = ("T", (5, 3), "float32", 80)
    refs = producer.call("send", cid, spec, "cuda")
    with pytest.raises(RemoteError, match="received incompatible tensor metadata"):
        consumers[0].call("receive", cid, attrs.evolve(refs, shape=(3, 5)), 0)
    for rank, consumer in enumerate(consumers):
        got, devices = consumer.call("receive", cid, refs, rank)
        assert got == expected(spec, rank, 2, 0) and devices == {"cuda:0"}


def test_receive_into_a_preallocated_out_tensor():
    with WorkerTensorChannel(2, shard_dim=0, timeout=1) as channel:  # one process plays both sides here
        src = torch.arange(10, dtype=torch.float32).reshape(5, 2)
        refs = channel.send({"a": src})
        dst = torch.empty(3, 2)
        with pytest.raises(ValueError, match=r"must be \(3, 2\) torch.float32"):
            channel.receive(refs, rank=0, out=torch.empty(2, 2))
        assert channel.receive(refs, rank=0, out=dst)["a"] is dst and torch.equal(dst, src[:3])
        assert torch.equal(channel.receive(refs, rank=1)["a"], src[3:])


# -- zero-copy receive -------------------------------------------------------------------------


def test_zero_copy_views_hold_the_slot_until_every_rank_releases(open_channel):
    channel, producer, consumers = open_channel(2, timeout=5)
    cid = channel.channel_id
    specs = [("T", (32, 16), "float32", 90 + k) for k in range(3)]
    one, two = (producer.call("send", cid, s) for s in specs[:2])  # both slots of the profile are in use
    for rank, consumer in enumerate(consumers):
        assert consumer.call("receive_view", cid, one, rank) == expected(specs[0])
        assert consumer.call("receive", cid, two, rank)[0] == expected(specs[1])  # a held transfer counts as received
    producer.submit("timed_send", cid, specs[2])  # slot 0 again: it must wait for transfer 1's release
    assert not producer.conn.poll(0.4), "the producer overwrote a slot that consumers still view"
    consumers[0].call("release", cid, one, 0)
    assert not producer.conn.poll(0.3), "released on one rank only: the slot is still held by rank 1"
    assert consumers[1].call("held_views", cid, 1) == [expected(specs[0])]  # still the producer's data
    consumers[1].call("release", cid, one, 1)
    elapsed, three = producer.result()
    assert 0.6 <= elapsed < 5 and isinstance(three, WorkerTensorRef)
    for rank, consumer in enumerate(consumers):
        assert consumer.call("receive_view", cid, three, rank) == expected(specs[2])
        consumer.call("release", cid, three, rank)


def test_a_held_transfer_times_out_the_producer_and_survives_a_discard(open_channel):
    channel, producer, (consumer,) = open_channel(1, timeout=0.5)
    cid = channel.channel_id
    spec = ("T", (8,), "int64", 95)
    one = producer.call("send", cid, spec)
    consumer.call("receive_view", cid, one, 0)
    channel.discard(one, sync=False)  # the rank holds a view: a discard does not free the slot
    with pytest.raises(TensorChannelTimeout):
        channel.discard(one, sync=True)
    producer.call("send", cid, spec)
    elapsed, error = producer.call("timed_send", cid, spec)
    assert error[0] == "TensorChannelTimeout" and "hold zero-copy views" in error[1] and elapsed >= 0.45
    assert consumer.call("held_views", cid, 0) == [expected(spec)]
    consumer.call("release", cid, one, 0)
    channel.discard(one, sync=True)  # resolved now


def test_release_errors_are_clear():
    with WorkerTensorChannel(2, timeout=1) as channel, WorkerTensorChannel(1, timeout=1) as other:
        src = torch.arange(6, dtype=torch.float32)
        refs = channel.send({"x": src})
        view = channel.receive(refs, rank=0, copy=False)["x"]
        assert torch.equal(view, src) and view.data_ptr() != src.data_ptr()
        with pytest.raises(TensorChannelError, match="rank 1 does not hold transfer 1"):
            channel.release(refs, rank=1)  # rank 1 never received it
        with pytest.raises(ValueError, match="out= needs copy=True"):
            channel.receive(refs, rank=1, copy=False, out=torch.empty(6))
        foreign = other.send(torch.zeros(2))
        with pytest.raises(TensorChannelError, match="cannot release refs of other channels"):
            channel.release([refs, foreign], rank=0)
        del view
        channel.release(refs, rank=0)
        with pytest.raises(TensorChannelError, match="rank 0 does not hold transfer 1 .released already"):
            channel.release(refs, rank=0)
        with pytest.raises(TensorChannelDiscarded):
            channel.receive(refs, rank=0, copy=False)  # released means resolved on that rank
        assert torch.equal(channel.receive(refs, rank=1)["x"], src)  # copy=True on the other rank
        with pytest.raises(TensorChannelError, match="received with copy=True"):
            channel.release(refs, rank=1)
        other.receive(foreign, rank=0)


SHM_TOO_SMALL = """
import os, pickle, torch
from engine.tensor_channel import TensorChannelError, WorkerTensorChannel
owner = WorkerTensorChannel(1, timeout=5)
producer = pickle.loads(pickle.dumps(owner))  # the producer's side, as a rank receives it
try:
    producer.send(torch.ones(1024 * 1024))  # 4 MiB into a 1 MiB /dev/shm
except TensorChannelError as exc:
    print("refused:", exc)
owner.close()
print("left:", sorted(os.listdir("/dev/shm")))
"""


def test_a_tensor_larger_than_dev_shm_is_a_typed_error_not_a_sigbus():
    """A segment was only sized (ftruncate): it mapped fine and the producer died of SIGBUS on its first write
    past what /dev/shm had free (exit -7, a rank lost with no word of why). Run in a mount namespace of its own
    with a 1 MiB /dev/shm."""
    done = with_small_dev_shm(SHM_TOO_SMALL)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: a shared-memory segment of 4194560 bytes does not fit in /dev/shm" in done.stdout, done.stdout
    assert "left: []" in done.stdout  # the segment that did not fit was unlinked, and close took the rest
