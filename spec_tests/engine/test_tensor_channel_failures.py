"""A tensor channel's send that is refused or fails part-way changes nothing: the transfers after it are received in
order, and nothing of it stays in /dev/shm.

A send took its transfer id before it looked at every tensor it carries. One refused after that (a tensor on the
``meta`` device as its second leaf, a nested tensor, a ``defaultdict`` tree) or failing on the way (a segment that
does not fit in /dev/shm) left an id that nothing could ever discard: every later receive of the channel failed
(``TensorChannelOrderError``) until the producer's sends timed out, in a worker group for every session. A profile
whose second slot did not fit left its first in /dev/shm after the channel's close.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import pickle
import types
import warnings

import pytest
import torch

from engine.tensor_channel import WorkerTensorChannel
from engine.workers import WorkerCallError

from .small_dev_shm import in_another_pid_namespace, with_small_dev_shm
from .tensor_ranks import SendingRank


def nested() -> torch.Tensor:
    """A nested tensor of the strided layout (the layout a plain tensor has), made without torch's prototype warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


@pytest.mark.parametrize("refused", [
    lambda: [torch.ones(3), torch.empty(3, device="meta")],
    lambda: collections.defaultdict(list, {"x": torch.ones(3)}),
    lambda: [torch.ones(3), nested()],
], ids=["meta-device", "defaultdict", "nested-tensor"])
def test_a_send_refused_for_what_it_carries_changes_nothing(refused):
    with WorkerTensorChannel(1, timeout=5) as channel:
        with pytest.raises(ValueError, match=r"^(tensor 1: |tree: )"):
            channel.send(refused())
        refs = channel.send(torch.arange(4.0))
        assert refs.transfer_id == 1  # the refused send took none
        assert channel.receive(refs, rank=0).tolist() == [0.0, 1.0, 2.0, 3.0]


SECOND_SLOT_DOES_NOT_FIT = """
import os, pickle, torch
from engine.tensor_channel import TensorChannelError, WorkerTensorChannel
owner = WorkerTensorChannel(1, timeout=5)
producer = pickle.loads(pickle.dumps(owner))  # the producer's side, as a rank receives it
try:
    producer.send([torch.ones(4), torch.ones(150_000)])  # 600 KB: one of its two slots fits in 1 MiB, not both
except TensorChannelError as exc:
    print("refused:", exc)
refs = producer.send(torch.arange(8.0))  # a new profile: it takes the failed one's entry
print("next:", refs.transfer_id, owner.receive(refs, rank=0).tolist())
owner.close()
print("left:", sorted(os.listdir("/dev/shm")))
"""


def test_a_send_that_fails_on_its_way_leaves_the_channel_in_order_and_nothing_in_dev_shm():
    """Run in a mount namespace of its own with a 1 MiB /dev/shm."""
    done = with_small_dev_shm(SECOND_SLOT_DOES_NOT_FIT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: a shared-memory segment of" in done.stdout, done.stdout
    assert "next: 2 [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]" in done.stdout, done.stdout
    assert "left: []" in done.stdout, done.stdout


OTHER_PID_NAMESPACE = """
from engine.tensor_channel import WorkerTensorChannel
WorkerTensorChannel(1).close()  # its first channel sweeps /dev/shm for the segments of processes that are gone
print("swept")
"""


def test_a_channel_made_in_another_pid_namespace_leaves_a_live_channels_segments_alone():
    """A process in a pid namespace of its own that shares /dev/shm (containers of one pod, ``docker --ipc=host``)
    cannot see the pid that named a live channel's segments: its first channel's sweep took them for a dead
    process's and unlinked them, and a rank that attached later found the channel closed."""
    with WorkerTensorChannel(1, timeout=5) as channel:
        refs = channel.send(torch.arange(4.0))
        made = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"cl_{channel.channel_id}_"))
        done = in_another_pid_namespace(OTHER_PID_NAMESPACE)
        assert done.returncode == 0 and "swept" in done.stdout, done.stderr[-2000:]
        assert sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"cl_{channel.channel_id}_")) == made
        consumer = pickle.loads(pickle.dumps(channel))  # what a rank attaching now is given
        assert consumer.receive(refs, rank=0).tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(("field", "value", "refusal"), [
    ("timeout", float("inf"), "timeout must be a finite number of seconds"),  # every wait of a transfer is bounded
    ("consumer_world_size", 10**9, "consumer_world_size must be an int in 1..1024"),  # it blamed /dev/shm's space
    ("cuda_ipc_slots", 10**9, "cuda_ipc_slots must be an int in 1..64"),  # taken until its first CUDA send
    ("shard_dim", 10**6, "shard_dim must be an int in -16..15"),  # taken until its first send
])
def test_channel_settings_past_what_a_channel_can_use_are_refused_naming_them(field, value, refusal):
    with pytest.raises(ValueError, match=f"^{refusal}"):
        WorkerTensorChannel(**{field: value})


def test_a_rank_given_as_a_bool_is_refused():
    """``True`` was rank 1 of two, ``False`` rank 0."""
    with WorkerTensorChannel(2, timeout=5) as channel:
        refs = channel.send(torch.ones(2))
        with pytest.raises(ValueError, match=r"^rank must be in \[0, 2\), got True"):
            channel.receive(refs, rank=True)
        with pytest.raises(ValueError, match=r"^rank must be in \[0, 2\), got False"):
            channel.discard(refs, rank=False)
        channel.discard(refs)


def test_a_rank_call_that_fails_after_its_send_leaves_the_channel_in_order(groups):
    """A rank's call that sent on a tensor channel and then raised: its refs never left the rank, nothing could
    discard the transfer, and every later receive of the channel (any session's) failed, out of order, until the
    producer's sends timed out. The rank discards what the failed call sent."""
    with WorkerTensorChannel(1, timeout=5) as channel:
        group = groups(functools.partial(SendingRank, channel=channel), close_timeout=5).start()
        with pytest.raises(WorkerCallError, match="a failure after the send"):
            group.call("send_ones", 3, then_fail=True)()
        refs = group.call("send_ones", 4)()
        assert channel.receive(refs, rank=0)["ones"].tolist() == [1.0] * 4
        group.close()


def test_a_wrong_out_tensor_is_refused_before_any_transfer_of_the_receive_is_taken():
    """``out`` for the second of two transfers had the wrong shape: the first was received and acked before that was
    found, so a retry with the right ``out`` found it discarded, its data gone."""
    with WorkerTensorChannel(1, timeout=5) as channel:
        first, second = channel.send(torch.ones(2)), channel.send(torch.ones(3))
        with pytest.raises(ValueError, match=r"^out for transfer 2 tensor 0 must be \(3,\) torch.float32, got \(99,\)"):
            channel.receive([first, second], out=[torch.empty(2), torch.empty(99)])
        got = channel.receive([first, second], out=[torch.empty(2), torch.empty(3)])
        assert [t.tolist() for t in got] == [[1.0, 1.0], [1.0, 1.0, 1.0]]


@dataclasses.dataclass
class Latent:
    tensor: torch.Tensor


@pytest.mark.parametrize(("holder", "tree"), [
    ("Latent", lambda: {"latent": Latent(torch.ones(2))}),
    ("set", lambda: [{torch.ones(2)}]),
    ("deque", lambda: collections.deque([torch.ones(2)])),
    ("UserDict", lambda: collections.UserDict({"x": torch.ones(2)})),
    ("mappingproxy", lambda: types.MappingProxyType({"x": torch.ones(2)})),
])
def test_tensors_in_a_container_the_channel_does_not_reach_are_refused(holder, tree):
    """They were left in the tree the send returned, so the scheduler held (and pickled) them whole, where the
    channel promises it holds only small refs."""
    with WorkerTensorChannel(1, timeout=5) as channel:
        with pytest.raises(ValueError, match=f"^tree: a {holder} in it holds tensors"):
            channel.send(tree())
        refs = channel.send({"plain": [torch.ones(2), (torch.zeros(1), {"n": 3})]})
        assert refs["plain"][1][1] == {"n": 3} and refs["plain"][0].transfer_id == 1
        channel.discard(refs)
