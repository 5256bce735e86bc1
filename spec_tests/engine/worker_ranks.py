"""Rank objects and factories for the process worker group tests.

They run in spawned child processes, so everything here is importable as
``spec_tests.engine.worker_ranks:<name>`` and imports nothing heavy.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any


def thread_timer_slack_ns() -> int | None:
    """The calling thread's timer slack as the kernel reports it (Linux ``PR_GET_TIMERSLACK``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # imported here: only this probe needs it

    return ctypes.CDLL(None).prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK; /proc shows only the process's


class EchoRank:
    """A rank that computes, raises, blocks or dies on request."""

    def __init__(self, *, rank: int, world_size: int, device: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.calls = 0
        self._never = threading.Event()

    def step(self, x: int, *, scale: int = 1, hold: bool = False) -> int:
        """``x * scale + rank``; with ``hold`` it never returns."""
        self.calls += 1
        if hold:
            self._never.wait()
        return x * scale + self.rank

    def info(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "device": self.device, "pid": os.getpid(),
                "calls": self.calls, "timer_slack_ns": thread_timer_slack_ns()}

    def boom(self, message: str) -> None:
        if self.rank == 1 or self.world_size == 1:
            raise ValueError(message)

    def boom_fatal(self) -> None:
        """Raise a FatalStageError (as a tensor channel's timeout is): the rank's stage can take no more work."""
        from engine import FatalStageError  # imported here: the ranks import nothing heavy until asked

        raise FatalStageError("the rank's device state is gone")

    def boom_unprintable(self) -> None:
        """Raise an exception whose ``str()`` raises too."""
        raise _Unprintable()

    def crash(self, code: int, rank: int = 0) -> None:
        if self.rank == rank:
            os._exit(code)

    def block(self) -> None:
        """Wait forever (until the process is killed)."""
        self._never.wait()

    def unpicklable(self) -> Any:
        return lambda: None

    def start_shell_sleeper(self) -> None:
        """Start a tool through the shell, in the background, as ``os.system("tool &")`` does."""
        os.system("sleep 600 &")

    def start_sleeper(self) -> int:
        """Start a process of its own (as model code may: compile workers, a tool) and return its pid."""
        self._sleeper = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL)
        return self._sleeper.pid


class _Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("no words for it")


class StubbornRank(EchoRank):
    """Ignores SIGTERM and hangs in close(): only SIGKILL stops it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def close(self) -> None:
        self._never.wait()


class FailingCloseRank(EchoRank):
    def close(self) -> None:
        raise RuntimeError(f"rank {self.rank} could not release its cache")


def failing_factory(*, rank: int, world_size: int, device: str) -> EchoRank:
    if rank == world_size - 1:
        raise RuntimeError("factory exploded while loading weights")
    return EchoRank(rank=rank, world_size=world_size, device=device)


def exiting_factory(*, rank: int, world_size: int, device: str) -> EchoRank:
    os._exit(5)


def echo_factory(*, rank: int, world_size: int, device: str) -> EchoRank:
    """A top-level callable factory (passed by reference, not by name)."""
    return EchoRank(rank=rank, world_size=world_size, device=device)


def _child_conn() -> Any:
    """The rank process's end of the pipe, read from ``engine.worker_child.child_main``'s frame.

    Only for the ranks below, which stand in for a rank built against another wire format.
    """
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "child_main":
        frame = frame.f_back
    assert frame is not None, "not called under engine.worker_child.child_main"
    return frame.f_locals["conn"]


def tuple_hello_factory(*, rank: int, world_size: int, device: str) -> EchoRank:
    """Says hello in the old tuple format before the real hello follows."""
    _child_conn().send(("ready", rank, os.getpid()))
    return EchoRank(rank=rank, world_size=world_size, device=device)


class TupleReplyRank(EchoRank):
    """Answers ``reply_in_tuples`` with an old-format tuple ahead of its real result."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._conn = _child_conn()

    def reply_in_tuples(self) -> int:
        self._conn.send(("result", 0, self.rank, True, 1))
        return 1


class HalfReplyRank(EchoRank):
    """Writes the start of a large reply, then stops itself (SIGSTOP): a rank frozen half-way through a write."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._conn = _child_conn()

    def write_raw(self, data: bytes) -> None:
        """Write ``data`` to the pipe as it stands (bytes no wire message is), then block."""
        os.write(self._conn.fileno(), data)
        self._never.wait()

    def half_reply_then_stop(self) -> None:
        os.write(self._conn.fileno(), struct.pack("!i", 4_000_000) + b"x" * 1000)
        os.kill(os.getpid(), signal.SIGSTOP)


def hanging_factory(*, rank: int, world_size: int, device: str) -> EchoRank:
    """A rank that never finishes loading (it waits until it is killed)."""
    threading.Event().wait()
    raise AssertionError("unreachable")


def explode_on_load() -> None:
    """Unpickling an :class:`ArgumentThatDoesNotLoad` calls this in the rank."""
    raise RuntimeError("this argument cannot be rebuilt in a rank")


class ArgumentThatDoesNotLoad:
    """Pickles in the parent; loading it raises (as a class the rank cannot import would)."""

    def __reduce__(self) -> Any:
        return (explode_on_load, ())


class TensorRank(EchoRank):
    def total(self, t: Any, *, scale: int = 1) -> float:
        return float(t.sum()) * scale + self.rank

    def tensor_and_lambda(self, n: int) -> Any:
        """A value that does not pickle, after a tensor that does (its shared memory offered before the failure)."""
        import torch

        return torch.ones(n), lambda: None

    def ones(self, n: int, *, after: float = 0.0) -> Any:
        """A CPU tensor of ``n`` ones (its shared memory held here until the parent fetches it), ``after`` seconds."""
        import torch

        time.sleep(after)  # bench-cost: the rank answers late on purpose (a drop while answers are due)
        return torch.ones(n)

    def shared_memory_fds(self) -> int:
        """This rank's descriptors of tensors' shared memory."""
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                count += "/dev/shm/torch_" in os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        return count
