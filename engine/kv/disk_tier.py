"""Disk tier of the prefix cache: evicted blocks as checksummed files, written off the step path.

Layout: DIR/<model fingerprint, 16 hex>/<block hash hex>.kv. A file holds its block hash, token ids,
the full model fingerprint, the block's K and V, and a checksum of all of it; a file that fails any
check is deleted and never served. A model, dtype, block-size or hash change gives another
fingerprint, hence another folder: old files are never read. Its own LRU bounds its size.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from engine.kv.hashing import BlockHash
from engine.stats import DiskTierStats

logger = logging.getLogger("prefixgate.engine")

MAGIC = b"PGKVBLK1"
_HEADER = struct.Struct("<8s32sHIQ")  # magic, fingerprint, hash length, number of tokens, payload bytes
_CHECKSUM_BYTES = 16  # xxh3_128 over everything before it
MAX_PENDING_BYTES = 256 * 2**20  # spills waiting for the writer; beyond this a spill is dropped


def model_fingerprint(model_path: Path, dtype: torch.dtype, block_size: int, block_shape: tuple[int, ...],
                      hash_algo: str, kv_dtype: torch.dtype | None = None) -> bytes:
    """What makes a block's KV valid: model config and weights, dtype (the one the K/V were computed in, and
    the one they are stored in where that differs), block size, KV shape, hash function."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    weights = [(p.name, p.stat().st_size, _sample_digest(p)) for p in sorted(Path(model_path).glob("*.safetensors"))]
    identity = {"config": config, "weights": weights, "dtype": str(dtype), "block_size": block_size,
                "block_shape": list(block_shape), "hash_algo": hash_algo}
    if kv_dtype not in (None, dtype):  # (an unchanged identity keeps the blocks saved before this field)
        identity["kv_dtype"] = str(kv_dtype)
    identity = json.dumps(identity, sort_keys=True)
    return hashlib.sha256(identity.encode()).digest()


def _sample_digest(path: Path) -> str:
    """64 KiB from the middle of a weights file: a retrained model with the same shapes differs there."""
    with path.open("rb") as f:
        f.seek(path.stat().st_size // 2)
        return hashlib.sha256(f.read(65536)).hexdigest()


def encode_block(fingerprint: bytes, block_hash: BlockHash, token_ids: tuple[int, ...], kv: torch.Tensor) -> bytes:
    payload = kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    body = (_HEADER.pack(MAGIC, fingerprint, len(block_hash), len(token_ids), len(payload)) + block_hash
            + struct.pack(f"<{len(token_ids)}q", *token_ids) + payload)
    return body + xxhash.xxh3_128_digest(body)


class CorruptBlock(ValueError):
    pass


def decode_block(data: bytes | bytearray, fingerprint: bytes, block_hash: BlockHash, token_ids: tuple[int, ...],
                 dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The block's KV, or CorruptBlock if anything about the file is off. Views `data`, never copies it."""
    if len(data) < _HEADER.size + _CHECKSUM_BYTES:
        raise CorruptBlock("truncated header")
    view = memoryview(bytearray(data) if isinstance(data, bytes) else data)  # writable: torch.frombuffer wants it
    body, checksum = view[:-_CHECKSUM_BYTES], view[-_CHECKSUM_BYTES:]
    if xxhash.xxh3_128_digest(body) != checksum:
        raise CorruptBlock("checksum mismatch")
    magic, file_fingerprint, hash_len, num_tokens, payload_len = _HEADER.unpack_from(body)
    if magic != MAGIC or file_fingerprint != fingerprint:
        raise CorruptBlock("another format or model")
    offset = _HEADER.size
    if bytes(body[offset:offset + hash_len]) != block_hash:
        raise CorruptBlock("block hash mismatch")
    offset += hash_len
    if struct.unpack_from(f"<{num_tokens}q", body, offset) != tuple(token_ids):
        raise CorruptBlock("token ids mismatch")  # a hash collision never serves another prompt's KV
    offset += 8 * num_tokens
    payload = body[offset:]
    if len(payload) != payload_len or payload_len != dtype.itemsize * math.prod(shape):
        raise CorruptBlock("payload size mismatch")
    return torch.frombuffer(payload, dtype=dtype).view(shape)


def _read(path: Path) -> bytearray:
    """The whole file in one writable buffer (the KV tensor is a view of it)."""
    with path.open("rb", buffering=0) as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        size = f.readinto(data)
    return data[:size] if size < len(data) else data


@dataclass(slots=True)
class _Pending:
    token_ids: tuple[int, ...]
    kv: torch.Tensor


class DiskTier:
    """Block hash -> file, LRU-bounded. Thread-safe: the engine thread reads, one writer thread writes."""

    def __init__(self, root: str | Path, max_bytes: int, fingerprint: bytes, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.dir = Path(root) / fingerprint.hex()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.block_shape = block_shape
        self.dtype = dtype
        self.stats = DiskTierStats()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file bytes, LRU first
        self._index_bytes = 0
        self._pending: dict[BlockHash, _Pending] = {}  # spilled, not yet on disk: still servable
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._build_index()
        self._writer = threading.Thread(target=self._write_loop, name="prefixgate-kv-disk", daemon=True)
        self._writer.start()

    # ---- engine thread

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._pending or block_hash in self._index

    def put(self, block_hash: BlockHash, token_ids: tuple[int, ...], kv: torch.Tensor, wait: bool = False) -> bool:
        """Queues a block for writing; False if the writer is too far behind (the block is lost),
        unless `wait`: then it waits for the writer (shutdown flush)."""
        size = kv.numel() * kv.element_size()
        if wait and self._pending_bytes + size > MAX_PENDING_BYTES:
            self.flush()
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
            if block_hash in self._pending:
                return True
            if self._pending_bytes + size > MAX_PENDING_BYTES:
                self.stats.dropped_spills += 1
                return False
            self._pending[block_hash] = _Pending(token_ids, kv)
            self._pending_bytes += size
        self._queue.put(block_hash)
        return True

    def has_room(self, size: int) -> bool:
        """Whether a block of `size` bytes can be queued now without waiting or being dropped."""
        return self._pending_bytes + size <= MAX_PENDING_BYTES

    def load(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The block's KV, verified; None if absent or bad (a bad file is deleted, with a warning)."""
        with self._lock:
            pending = self._pending.get(block_hash)
            if pending is None and block_hash in self._index:
                self._index.move_to_end(block_hash)
        if pending is not None:
            return pending.kv if pending.token_ids == tuple(token_ids) else None
        try:
            data = _read(self._path(block_hash))
        except FileNotFoundError:  # its LRU dropped it a moment ago
            with self._lock:
                self._forget(block_hash)
            return None
        except OSError as exc:
            return self._drop_bad(block_hash, exc)
        try:
            return decode_block(data, self.fingerprint, block_hash, token_ids, self.dtype, self.block_shape)
        except (CorruptBlock, struct.error) as exc:
            return self._drop_bad(block_hash, exc)

    def _drop_bad(self, block_hash: BlockHash, exc: Exception) -> None:
        logger.warning("disk tier: dropping %s (%s); its tokens are computed", self._path(block_hash).name, exc)
        with self._lock:
            self.stats.corrupt += 1
            self._forget(block_hash)

    def flush(self) -> None:
        """Waits until every queued block is on disk."""
        self._queue.join()

    @property
    def closed(self) -> bool:
        return not self._writer.is_alive()

    def close(self) -> None:
        if self.closed:
            return
        self.flush()
        self._queue.put(None)
        self._writer.join()

    def snapshot(self) -> DiskTierStats:
        with self._lock:
            self.stats.files, self.stats.bytes = len(self._index), self._index_bytes
            return DiskTierStats(**{f: getattr(self.stats, f) for f in DiskTierStats.__slots__})

    # ---- index and writer

    def _path(self, block_hash: BlockHash) -> Path:
        return self.dir / f"{block_hash.hex()}.kv"

    def _build_index(self) -> None:
        """Names and sizes only: no KV is read until a hit."""
        entries = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.endswith(".tmp"):  # a write cut short by a crash
                os.unlink(entry.path)
                continue
            try:
                block_hash = BlockHash(bytes.fromhex(name.removesuffix(".kv")))
                stat = entry.stat()
            except (ValueError, OSError):
                continue
            entries.append((stat.st_mtime_ns, block_hash, stat.st_size))
        with self._lock:
            for _, block_hash, size in sorted(entries):
                self._add(block_hash, size)
            self._trim()

    def _write_loop(self) -> None:
        while (block_hash := self._queue.get()) is not None:
            try:
                self._write(block_hash)
            except Exception:  # a full or broken disk loses this block, never the engine
                logger.exception("disk tier: writing a block failed")
                with self._lock:
                    self._drop_pending(block_hash)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, block_hash: BlockHash) -> None:
        pending = self._pending[block_hash]
        data = encode_block(self.fingerprint, block_hash, pending.token_ids, pending.kv)
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # atomic: a reader sees the whole file or none
        with self._lock:
            self._drop_pending(block_hash)
            self._add(block_hash, len(data))
            self.stats.writes += 1
            self._trim()

    def _drop_pending(self, block_hash: BlockHash) -> None:
        pending = self._pending.pop(block_hash)
        self._pending_bytes -= pending.kv.numel() * pending.kv.element_size()

    def _add(self, block_hash: BlockHash, size: int) -> None:
        self._index[block_hash] = size
        self._index_bytes += size

    def _trim(self) -> None:
        while self._index_bytes > self.max_bytes and self._index:
            self._forget(next(iter(self._index)))
            self.stats.evictions += 1

    def _forget(self, block_hash: BlockHash) -> None:
        self._index_bytes -= self._index.pop(block_hash, 0)
        try:
            os.unlink(self._path(block_hash))
        except FileNotFoundError:
            pass
