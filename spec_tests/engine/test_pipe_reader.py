"""The monitor's pipe reader: whole messages out of whatever a readable pipe holds, never a wait for the rest."""

from __future__ import annotations

import multiprocessing
import os
import struct
import threading
from multiprocessing.connection import wait

import pytest

from engine.pipe_reader import MessageReader, PipeClosed


def _read_until(reader: MessageReader, conn, count: int) -> list[bytes]:
    got: list[bytes] = []
    while len(got) < count:
        assert wait([conn], 10), "the pipe went quiet before every message arrived"
        got += reader.read_ready()
    return got


def test_messages_of_every_size_arrive_whole_and_in_order():
    ours, theirs = multiprocessing.Pipe(duplex=True)
    sent = [b"", b"a", b"x" * 70_000, bytes(range(256)) * 20_000, b"last"]  # 5 MB: many reads
    writer = threading.Thread(target=lambda: [theirs.send_bytes(m) for m in sent])
    writer.start()
    try:
        assert _read_until(MessageReader(ours.fileno()), ours, len(sent)) == sent
    finally:
        writer.join()
        ours.close()
        theirs.close()


def test_a_half_written_message_waits_in_the_buffer_and_the_read_returns():
    ours, theirs = multiprocessing.Pipe(duplex=True)
    reader = MessageReader(ours.fileno())
    raw = theirs.fileno()
    os.write(raw, struct.pack("!i", 10) + b"01234")
    assert reader.read_ready() == [] and reader.pending_bytes == 9  # returned at once with what was there
    os.write(raw, b"56789" + struct.pack("!i", -1) + struct.pack("!Q", 3) + b"abc")  # the long header, too
    assert reader.read_ready() == [b"0123456789", b"abc"] and reader.pending_bytes == 0
    theirs.close()
    with pytest.raises(PipeClosed, match="end of pipe"):
        reader.read_ready()
    ours.close()


def test_bytes_that_are_not_framed_messages_are_a_closed_pipe():
    ours, theirs = multiprocessing.Pipe(duplex=True)
    os.write(theirs.fileno(), struct.pack("!i", -7) + b"junk")
    with pytest.raises(PipeClosed, match="a length of -7"):
        MessageReader(ours.fileno()).read_ready()
    ours.close()
    theirs.close()
