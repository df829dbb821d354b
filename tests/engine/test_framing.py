"""Frames over pipes (engine/framing.py: the API process's ends; engine/engine_process.py: the engine's): frames
survive any split, a corrupt length is refused, and a full pipe blocks neither writer."""
from __future__ import annotations

import asyncio
import fcntl
import os
import pickle

import pytest

from engine.engine_process import _PipeSeam
from engine.framing import HEADER, MAX_FRAME_BYTES, FrameDecoder, FramingError, LoopPipes, PipeWriter, encode
from engine.messages import AbortRequest, AddRequest, CommandReply, EngineError, StartFailed
from engine.sampling_params import SamplingParams

PAGE = 4096  # the smallest pipe the kernel makes


def small_pipe() -> tuple[int, int]:
    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PAGE)
    return read_fd, write_fd


def drain(fd: int) -> bytes:
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data += chunk


def frames_of(decoder: FrameDecoder) -> list[bytes]:
    return list(iter(decoder.next_frame, None))


def test_frames_split_anywhere_come_out_whole_and_in_order():
    messages = [AbortRequest("a"), StartFailed("x" * 300), CommandReply(7, error=EngineError("ValueError", "no"))]
    stream = b"".join(encode(message) for message in messages)
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder()
        decoder.feed(stream[:cut])
        payloads = frames_of(decoder)
        decoder.feed(stream[cut:])
        payloads += frames_of(decoder)
        assert [pickle.loads(p) for p in payloads] == messages


def test_a_byte_at_a_time_gives_each_frame_once_its_last_byte_is_in():
    decoder, stream, seen = FrameDecoder(), encode(AbortRequest("b")), []
    for i in range(len(stream)):
        decoder.feed(stream[i:i + 1])
        seen.append(decoder.next_frame())
    assert seen[:-1] == [None] * (len(stream) - 1) and pickle.loads(seen[-1]) == AbortRequest("b")


def test_a_corrupt_length_is_refused_at_once():
    decoder = FrameDecoder()
    decoder.feed(HEADER.pack(MAX_FRAME_BYTES + 1))
    with pytest.raises(FramingError, match=f"a frame of {MAX_FRAME_BYTES + 1} bytes"):
        decoder.next_frame()


def test_a_writer_on_a_full_pipe_keeps_the_rest_in_order_and_never_blocks():
    read_fd, write_fd = small_pipe()
    writer = PipeWriter(write_fd)
    data = [bytes([i]) * 3000 for i in range(3)]
    for chunk in data:
        writer.write(chunk)  # a blocking write would hang here: nobody reads yet
    assert writer.flush() is False  # still full
    received = drain(read_fd)
    assert writer.pending > 0 and len(received) + writer.pending == 9000  # the kernel took part of it
    while not writer.flush():
        received += drain(read_fd)
    received += drain(read_fd)
    assert received == b"".join(data) and writer.pending == 0
    os.close(read_fd)
    with pytest.raises(BrokenPipeError):
        writer.write(b"x")
    os.close(write_fd)


@pytest.fixture
def seam():
    """The engine's seam, and the API process's ends of its pipes."""
    engine_reads, api_writes = os.pipe()
    api_reads, engine_writes = small_pipe()
    yield _PipeSeam(engine_reads, engine_writes), api_writes, api_reads
    for fd in (engine_reads, api_writes, api_reads):
        os.close(fd)


def test_the_engine_reads_every_message_that_arrived_and_keeps_a_partial_one(seam):
    engine, api_writes, _ = seam
    add = AddRequest("r1", list(range(5000)), SamplingParams(max_tokens=3))
    stream = encode(add) + encode(AbortRequest("r1"))
    os.write(api_writes, stream[:-3])
    assert engine.receive(0) == [add]
    os.write(api_writes, stream[-3:])
    assert engine.receive(1.0) == [AbortRequest("r1")]


def test_the_engine_never_blocks_on_a_full_pipe_and_flushes_at_each_receive(seam):
    engine, _, api_reads = seam
    sent = [StartFailed(str(i) * 1000) for i in range(10)]  # about 10 KB into a 4 KB pipe, nobody reading
    for message in sent:
        engine.send(message)
    assert engine._out.pending > 0
    decoder, received = FrameDecoder(), []
    for _ in range(len(sent)):  # the API process reads a pipeful, the engine reaches a step boundary
        decoder.feed(drain(api_reads))
        engine.receive(0)
        received += frames_of(decoder)
    assert [pickle.loads(p) for p in received] == sent and engine._out.pending == 0


def test_the_api_process_gone_reads_as_a_broken_pipe():
    engine_reads, api_writes = os.pipe()
    api_reads, engine_writes = os.pipe()
    engine = _PipeSeam(engine_reads, engine_writes)
    os.close(api_writes)
    with pytest.raises(BrokenPipeError, match="closed its end of the inbound pipe"):
        engine.receive(0)
    for fd in (engine_reads, engine_writes, api_reads):
        os.close(fd)


async def test_the_api_side_never_blocks_on_a_full_pipe_and_its_loop_writes_the_rest():
    to_engine_r, to_engine_w = small_pipe()
    from_engine_r, from_engine_w = os.pipe()
    pipes = LoopPipes(to_engine_w, from_engine_r)
    frames = [encode(StartFailed(str(i) * 1000)) for i in range(10)]
    for frame in frames:
        pipes.send(frame)  # about 10 KB into a 4 KB pipe that nobody reads yet
    os.set_blocking(to_engine_r, False)
    received = b""
    for _ in range(100):
        received += drain(to_engine_r)
        if len(received) == sum(map(len, frames)):
            break
        await asyncio.sleep(0)  # the loop writes the rest as the pipe gets room
    assert received == b"".join(frames)
    pipes.close()
    for fd in (to_engine_r, from_engine_w):
        os.close(fd)


async def test_the_api_side_hands_on_frames_in_order_and_keeps_them_while_paused():
    to_engine_r, to_engine_w = os.pipe()
    from_engine_r, from_engine_w = os.pipe()
    pipes = LoopPipes(to_engine_w, from_engine_r)
    got = asyncio.Queue()

    def first_only(frames):
        got.put_nowait(next(frames))
        pipes.pause()  # the second frame stays unread

    pipes.listen(first_only)
    os.write(from_engine_w, encode(AbortRequest("1")) + encode(AbortRequest("2")))
    assert pickle.loads(await got.get()) == AbortRequest("1")
    pipes.listen(lambda frames: [got.put_nowait(payload) for payload in frames])
    assert pickle.loads(await got.get()) == AbortRequest("2")
    pipes.close()
    for fd in (to_engine_r, from_engine_w):
        os.close(fd)
