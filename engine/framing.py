"""Length-prefixed frames over a pipe: how engine/messages.py's messages cross between the API process and the
engine process (engine/process_client.py, engine/engine_process.py).

A frame is a 4-byte big-endian length and that many bytes of pickle. Both ends write non-blocking: what the pipe
does not take at once waits in the writer's pending buffer, flushed when the pipe has room (the API's event loop
watches for it: LoopPipes; the engine's step loop flushes at step boundaries and while idle). So a side whose
reader is slow never blocks in a write, and neither side can wait on the other in a cycle. No I/O thread: one
`os.write` per message when the pipe has room, where a ZeroMQ send woke a thread that competed for the sender's
core."""
from __future__ import annotations

import asyncio
import fcntl
import os
import pickle
import struct
from collections.abc import Callable, Iterator

HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30  # a longer frame is a corrupt length, not a message
PIPE_BYTES = 1 << 20  # asked of the kernel per pipe: a long prompt's AddRequest crosses in one write
READ_BYTES = 1 << 18


Frames = Iterator[bytes]  # the payloads of the frames read so far, in order; FramingError where bytes are no frame


class FramingError(ValueError):
    """The bytes on the pipe are not a frame."""


def encode(message: object) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


def pipe() -> tuple[int, int]:
    """A new pipe (read end, write end), enlarged where the kernel allows it."""
    read_fd, write_fd = os.pipe()
    try:
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError):  # not Linux, or above /proc/sys/fs/pipe-max-size: the default 64 KiB
        pass
    return read_fd, write_fd


class FrameDecoder:
    """Bytes in as they arrive, whole frames' payloads out."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def next_frame(self) -> bytes | None:
        """The oldest complete frame's payload, or None until one has arrived (FramingError: a corrupt length)."""
        if len(self._buffer) < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buffer)
        if length > MAX_FRAME_BYTES:
            raise FramingError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
        end = HEADER.size + length
        if len(self._buffer) < end:
            return None
        payload = bytes(self._buffer[HEADER.size:end])
        del self._buffer[:end]
        return payload


class PipeWriter:
    """The write end of a pipe, non-blocking: `write` sends what the pipe takes now and keeps the rest, in order,
    for `flush`. BrokenPipeError when the reader has gone."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self._pending = bytearray()

    @property
    def pending(self) -> int:
        """Bytes written but not yet in the pipe."""
        return len(self._pending)

    def write(self, data: bytes) -> None:
        if self._pending:
            self._pending += data
            self.flush()
            return
        try:
            sent = os.write(self.fd, data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self._pending += data[sent:]

    def flush(self) -> bool:
        """Sends what the pipe takes of the pending bytes; True when none are left."""
        while self._pending:
            try:
                sent = os.write(self.fd, self._pending)
            except BlockingIOError:
                return False
            del self._pending[:sent]
        return True


class LoopPipes:
    """The API process's ends of an engine's two pipes, on its event loop: frames out without ever blocking (the
    loop writes what a full pipe did not take as it gets room), frames in as they arrive."""

    def __init__(self, write_fd: int, read_fd: int) -> None:
        self._loop = asyncio.get_running_loop()
        self._writer = PipeWriter(write_fd)
        os.set_blocking(read_fd, False)
        self._read_fd = read_fd
        self._frames = FrameDecoder()
        self._on_frames: Callable[[Frames], None] | None = None
        self._closed = False

    def send(self, frame: bytes) -> None:
        """Dropped if the reader has gone."""
        try:
            self._writer.write(frame)
        except BrokenPipeError:
            return
        if self._writer.pending:
            self._loop.add_writer(self._writer.fd, self._flush)

    def listen(self, on_frames: Callable[[Frames], None]) -> None:
        """`on_frames` gets the frames as they arrive (those read before this call first), until pause()."""
        self._on_frames = on_frames
        self._loop.add_reader(self._read_fd, self._read)
        self._loop.call_soon(self._deliver)

    def pause(self) -> None:
        """No more frames to the listener; the unread ones wait for the next listen()."""
        self._on_frames = None
        self._loop.remove_reader(self._read_fd)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.pause()
        self._loop.remove_writer(self._writer.fd)
        os.close(self._writer.fd)
        os.close(self._read_fd)

    def _flush(self) -> None:
        try:
            flushed = self._writer.flush()
        except BrokenPipeError:
            flushed = True
        if flushed:
            self._loop.remove_writer(self._writer.fd)

    def _read(self) -> None:
        try:
            data = os.read(self._read_fd, READ_BYTES)
        except BlockingIOError:
            return
        if not data:  # the writer has closed its end (its process has exited)
            self._loop.remove_reader(self._read_fd)
            return
        self._frames.feed(data)
        self._deliver()

    def _deliver(self) -> None:
        if self._on_frames is not None:
            self._on_frames(self._complete_frames())

    def _complete_frames(self) -> Frames:
        while self._on_frames is not None and (payload := self._frames.next_frame()) is not None:
            yield payload
