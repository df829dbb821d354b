"""Disk tier of the prefix cache: evicted blocks as checksummed files, written off the step path.

Layout: DIR/<model fingerprint, 16 hex>/<block hash hex>.kv. A file holds its block hash, token ids,
the full model fingerprint, a tag of the tenant whose cache it is (so DELETE /v1/cache finds its files, in every
fingerprint's folder), the block's K and V, and a checksum of all of it; a file that fails any
check is deleted and never served. A model (by a hash of its weights' full content), dtype, block-size
or hash change gives another fingerprint, hence another folder: old files are never read, and are the
first reclaimed by the one size cap of DIR. DIR/.lock keeps a second server out of the folder.

A disk error of any kind costs at most a cache miss: the tier that cannot open its folder is not used,
a failed write drops that block (and makes the writer back off while the disk stays full), a failed
delete only leaves a file behind (an erase's is never served, is reported, and goes once the folder lets it).
Files are not fsync'ed: a power cut can lose the last writes or leave torn files, which their checksums reject.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import queue
import re
import stat
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from engine.kv.hashing import BlockHash, tenant_tag
from engine.stats import DiskTierStats

logger = logging.getLogger("prefixgate.engine")

MAGIC = b"PGKVBLK2"
# magic, fingerprint, tenant tag, hash length, number of tokens, payload bytes
_HEADER = struct.Struct("<8s32s8sHIQ")
_CHECKSUM_BYTES = 16  # xxh3_128 over everything before it
MAX_PENDING_BYTES = 256 * 2**20  # spills waiting for the writer; beyond this a spill is dropped
BACKOFF_S = (1.0, 60.0)  # after a failed write no spill is taken for this long, doubling while writes keep failing
_HASH_CHUNK = 8 * 2**20
TIER_VERSION = 2  # part of the fingerprint: a new version leaves the blocks of older tiers unread (model_fingerprint)
_FINGERPRINT_FOLDER = re.compile(r"[0-9a-f]{16}")


def model_fingerprint(model_path: Path, dtype: torch.dtype, block_size: int, block_shape: tuple[int, ...],
                      hash_algo: str, kv_dtype: torch.dtype | None = None, weights_format: str = "none") -> bytes:
    """What makes a block's KV valid: model config and weights (and the format they run in: quantized
    kernels sum in another order than float ones), dtype (the one the K/V were computed in, and the one
    they are stored in where that differs), block size, KV shape, hash function."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    files = sorted([*Path(model_path).glob("*.safetensors"), *Path(model_path).glob("*.gguf")])
    weights = [(p.name, p.stat().st_size, _content_digest(p)) for p in files]
    identity = {"config": config, "weights": weights, "dtype": str(dtype), "block_size": block_size,
                "block_shape": list(block_shape), "hash_algo": hash_algo,
                # 2: a tier of version 1 may hold blocks computed over restored pins that start-up probes had
                # overwritten (engine/core.py restores pins after the probes since): left behind, not read
                "tier": TIER_VERSION}
    if kv_dtype not in (None, dtype):  # (named only where K/V are stored in another dtype than computed in)
        identity["kv_dtype"] = str(kv_dtype)
    if weights_format != "none":
        identity["weights_format"] = weights_format
    identity = json.dumps(identity, sort_keys=True)
    return hashlib.sha256(identity.encode()).digest()


def _content_digest(path: Path) -> str:
    """xxh3-128 of the whole weights file: a fine-tune of the same shapes differs somewhere, maybe only
    there (cheap: read from the page cache the load just filled; docs/speed.md#start-up)."""
    digest = xxhash.xxh3_128()
    with path.open("rb", buffering=0) as f:
        buf = bytearray(_HASH_CHUNK)
        while size := f.readinto(buf):
            digest.update(memoryview(buf)[:size])
    return digest.hexdigest()


def encode_block(fingerprint: bytes, block_hash: BlockHash, token_ids: tuple[int, ...], kv: torch.Tensor,
                 owner: bytes = tenant_tag(None)) -> bytes:
    """`owner`: the tenant_tag() of the tenant whose cache the block is."""
    payload = kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    body = (_HEADER.pack(MAGIC, fingerprint, owner, len(block_hash), len(token_ids), len(payload))
            + block_hash
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
    magic, file_fingerprint, _, hash_len, num_tokens, payload_len = _HEADER.unpack_from(body)
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


def _owner(path: Path) -> bytes | None:
    """The tenant tag in a block file's header (None: unreadable, or not a block file of this format)."""
    try:
        with _open_block(path) as f:
            header = f.read(_HEADER.size)
    except OSError:
        return None
    if len(header) < _HEADER.size or header[:len(MAGIC)] != MAGIC:
        return None
    return _HEADER.unpack(header)[2]


def _retagged(path: Path, tenant: str | None) -> bytes:
    """The file's bytes with `tenant`'s tag and a new checksum; CorruptBlock if its checksum fails first: a
    checksum over damaged bytes would make them read as sound."""
    data = bytes(_read(path))
    body = data[:-_CHECKSUM_BYTES]
    if len(data) < _HEADER.size + _CHECKSUM_BYTES or xxhash.xxh3_128_digest(body) != data[-_CHECKSUM_BYTES:]:
        raise CorruptBlock("checksum mismatch")
    fields = list(_HEADER.unpack_from(body))
    fields[2] = tenant_tag(tenant)
    body = _HEADER.pack(*fields) + body[_HEADER.size:]
    return body + xxhash.xxh3_128_digest(body)


def _open_block(path: Path):
    """The block file, opened to read; OSError where it is not a regular file: a FIFO put in a block's place would
    hold its reader (the engine's step) until some writer came."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (no effect on a regular file: its reads still wait)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _read(path: Path) -> bytearray:
    """The whole file in one writable buffer (the KV tensor is a view of it)."""
    with _open_block(path) as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        size = f.readinto(data)
    return data[:size] if size < len(data) else data


def _probe_writable(folder: Path) -> None:
    """Raises if no block could be written there (an immutable or read-only folder)."""
    probe = folder / f".probe-{os.getpid()}"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))  # (a full disk still has room for this)
    os.unlink(probe)


def _save_pins(path: Path, records: list) -> None:
    tmp = path.with_suffix(".tmp")  # (a leftover is removed at the next start, as block temporaries are)
    try:
        tmp.write_text(json.dumps({"pins": records}))
        os.replace(tmp, path)
    except OSError as exc:
        _unlink(tmp)
        logger.warning("disk tier: could not save the pinned prefixes to %s (%s); a restart forgets them", path, exc)


def _load_pins(path: Path) -> list:
    try:
        records = json.loads(bytes(_read(path)))["pins"]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("disk tier: ignoring unreadable %s (%s)", path, exc)
        return []
    return records if isinstance(records, list) else []


@dataclass(slots=True)
class _Pending:
    token_ids: tuple[int, ...]
    kv: torch.Tensor
    owner: bytes


class DiskTierUnavailable(OSError):
    pass


def open_disk_tier(root: str | Path, max_bytes: int, fingerprint: bytes, block_shape: tuple[int, ...],
                   dtype: torch.dtype) -> "DiskTier | None":
    """The tier, or None (with one warning) when its folder cannot be used: the server runs without it."""
    try:
        return DiskTier(root, max_bytes, fingerprint, block_shape, dtype)
    except OSError as exc:
        logger.warning("disk tier: not used, the server runs without it: %s", exc)
        return None


def _lock_folder(root: Path) -> int:
    """An exclusive lock on ROOT/.lock for this process's life (released by close, or by the kernel at exit)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DiskTierUnavailable(f"{root} is in use by another server (pid {holder}); give each server its own "
                                  "--kv-disk-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _error_reason(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "no_space"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission"
    return "io"


def _write_atomically(path: Path, data: bytes) -> OSError | None:
    """`data` as the file `path`, whole or not at all to a reader (a temporary renamed over it); the error, with no
    temporary left to fill the disk further, where it failed."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        _unlink(tmp)
        return exc
    return None


def _unlink(path: Path) -> OSError | None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return exc
    return None


class DiskTier:
    """Block hash -> file, LRU-bounded. Thread-safe: the engine thread reads, one writer thread writes."""

    def __init__(self, root: str | Path, max_bytes: int, fingerprint: bytes, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        root = Path(root)
        self._lock_fd = _lock_folder(root)
        try:
            self.dir = root / fingerprint.hex()[:16]
            self.dir.mkdir(exist_ok=True)
            _probe_writable(self.dir)
        except OSError:
            os.close(self._lock_fd)
            raise
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.block_shape = block_shape
        self.dtype = dtype
        self.stats = DiskTierStats()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file bytes, LRU first
        self._index_bytes = 0
        self._pending: dict[BlockHash, _Pending] = {}  # spilled, not yet on disk: still servable
        self._pending_bytes = 0
        self._others: deque[tuple[Path, int]] = deque()  # files of other fingerprints, oldest first: reclaimed first
        self._others_bytes = 0
        # files an erase could not delete (the folder refused): out of the index, tried again -> their tenant tag
        self._undeleted: dict[Path, bytes] = {}
        self._backoff_until = 0.0  # time.monotonic(): no spill is taken before it
        self._backoff_s = 0.0
        self._last_touch_ns = 0
        self._full_disk_said = False  # (warned once that the disk filled up below the cap)
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._index_others(root)
        self._build_index()
        self._writer = threading.Thread(target=self._write_loop, name="prefixgate-kv-disk", daemon=True)
        self._writer.start()

    # ---- engine thread

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._pending or block_hash in self._index

    def put(self, block_hash: BlockHash, token_ids: tuple[int, ...], kv: torch.Tensor,
            owner: bytes = tenant_tag(None), wait: bool = False) -> bool:
        """Queues a block of `owner`'s cache (a tenant_tag()) for writing; False if the writer is too far behind
        (the block is lost), unless `wait`: then it waits for the writer (shutdown flush)."""
        size = kv.numel() * kv.element_size()
        if wait and self._pending_bytes + size > MAX_PENDING_BYTES:
            self.flush()
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
            if block_hash in self._pending:
                return True
            if self._pending_bytes + size > MAX_PENDING_BYTES or time.monotonic() < self._backoff_until:
                self.stats.dropped_spills += 1
                return False
            self._pending[block_hash] = _Pending(token_ids, kv, owner)
            self._pending_bytes += size
        self._queue.put(block_hash)
        return True

    def has_room(self, size: int) -> bool:
        """Whether a block of `size` bytes can be queued now without waiting or being dropped."""
        return self._pending_bytes + size <= MAX_PENDING_BYTES

    def load(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> tuple[torch.Tensor, bytes] | None:
        """The block's KV, verified, and the tag of the tenant whose cache it is; None if absent or bad (a bad file
        is deleted, with a warning)."""
        with self._lock:
            pending = self._pending.get(block_hash)
            if pending is None and block_hash in self._index:
                self._index.move_to_end(block_hash)
        if pending is not None:
            return (pending.kv, pending.owner) if pending.token_ids == tuple(token_ids) else None
        try:
            data = _read(self._path(block_hash))
        except FileNotFoundError:  # its LRU dropped it a moment ago
            with self._lock:
                self._forget(block_hash)
            return None
        except OSError as exc:
            return self._drop_bad(block_hash, exc)
        try:
            kv = decode_block(data, self.fingerprint, block_hash, token_ids, self.dtype, self.block_shape)
        except (CorruptBlock, struct.error) as exc:
            return self._drop_bad(block_hash, exc)
        self.touch(block_hash)
        return kv, _HEADER.unpack_from(data)[2]

    def touch(self, block_hash: BlockHash) -> None:
        """Marks a file used now, so the order after a restart (by file times) keeps this use."""
        # strictly increasing: consecutive touches within one tick of a coarse file clock keep their order
        self._last_touch_ns = max(time.time_ns(), self._last_touch_ns + 1)
        try:
            os.utime(self._path(block_hash), ns=(self._last_touch_ns, self._last_touch_ns))
        except OSError:  # gone, or a folder that refuses it: only the order after a restart suffers
            pass

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
        self.retry_deletes()
        os.close(self._lock_fd)

    def snapshot(self) -> DiskTierStats:
        with self._lock:
            self.stats.files, self.stats.bytes = len(self._index), self._index_bytes
            copy = DiskTierStats(**{f: getattr(self.stats, f) for f in DiskTierStats.__slots__})
            copy.write_errors = dict(self.stats.write_errors)
            return copy

    def erase(self, tenant: str | None, handed: Mapping[BlockHash, str | None]) -> tuple[int, int]:
        """Deletes every block file of `tenant`'s cache (DELETE /v1/cache), here and in the folders of other
        fingerprints (a later start under their configuration would serve them), with the tenant's pins saved there;
        but a file of `handed` (a block another tenant's pin holds, shared through a salt) passes to that tenant.
        Reads each file's header only (a file passed on whole). Returns how many files went, and how many of the
        tenant's the folder would not let go: those are never served and are deleted again at each erase, idle
        moment and close. Called on the engine thread, the only one that queues writes: after the flush nothing of
        the tenant's is pending."""
        self.flush()
        tag, doomed = tenant_tag(tenant), []
        with self._lock:
            hashes = list(self._index)
        for block_hash in hashes:
            path = self._path(block_hash)
            if _owner(path) != tag:
                continue
            if block_hash in handed:
                self._pass_on(path, handed[block_hash], block_hash)
                continue
            with self._lock:
                self._unindex(block_hash)
            doomed.append(path)
        doomed += self._erase_others(tenant, tag)
        return self._delete(doomed, tag)

    def _erase_others(self, tenant: str | None, tag: bytes) -> list[Path]:
        """The tenant's files in the other fingerprints' folders (out of the cap's list), its saved pins there
        dropped, and the files other tenants' saved pins there hold passed to them."""
        handed: dict[Path, str | None] = {}
        for folder in self._other_folders():
            for record in self._drop_saved_pins(folder / "pins.json", tenant):
                for hash_hex, _ in record["blocks"]:
                    handed[folder / f"{hash_hex}.kv"] = record.get("tenant")
        with self._lock:
            others = list(self._others)
        doomed = set()
        for path, _ in others:
            if path.suffix != ".kv" or _owner(path) != tag:
                continue
            if path in handed:
                self._pass_on(path, handed[path])
            else:
                doomed.add(path)
        with self._lock:
            self._others_bytes -= sum(size for path, size in self._others if path in doomed)
            self._others = deque((path, size) for path, size in self._others if path not in doomed)
        return list(doomed)

    def _other_folders(self) -> list[Path]:
        try:
            return [Path(entry.path) for entry in os.scandir(self.dir.parent)
                    if entry.is_dir() and entry.path != str(self.dir) and _FINGERPRINT_FOLDER.fullmatch(entry.name)]
        except OSError:  # (their files' tags are still read: those are listed since the start)
            return []

    def _drop_saved_pins(self, path: Path, tenant: str | None) -> list[dict]:
        """Drops `tenant`'s pins from another configuration's pins.json; returns the others' (well-formed ones)."""
        records = _load_pins(path)
        others = [r for r in records if not (isinstance(r, dict) and r.get("tenant") == tenant)]
        if len(others) < len(records):
            _save_pins(path, others)
        return [r for r in others if isinstance(r, dict) and isinstance(r.get("blocks"), list)
                and all(isinstance(b, list) and len(b) == 2 and isinstance(b[0], str) for b in r["blocks"])]

    def _pass_on(self, path: Path, tenant: str | None, block_hash: BlockHash | None = None) -> None:
        """The block file becomes `tenant`'s (its tag rewritten, and its checksum, once the old one is verified): its
        erase takes it then. A damaged file is dropped, a cache miss; one that cannot be rewritten keeps its tag (it
        goes with the old owner's next erase)."""
        fresh = path.with_suffix(".retag")
        try:
            fresh.write_bytes(_retagged(path, tenant))
            os.replace(fresh, path)
        except CorruptBlock as exc:
            if block_hash is None:
                logger.warning("disk tier: deleting %s (%s)", path, exc)
                _unlink(path)
            else:
                self._drop_bad(block_hash, exc)
        except (OSError, struct.error) as exc:
            _unlink(fresh)
            logger.warning("disk tier: could not pass %s to another tenant (%s)", path.name, exc)

    def _delete(self, paths: list[Path], tag: bytes) -> tuple[int, int]:
        """Deletes `paths` and the files of tenant `tag` that erases left behind; returns how many went and how
        many stay."""
        with self._lock:
            paths += [path for path, owner in self._undeleted.items() if owner == tag]
        errors = []
        for path in paths:
            error = _unlink(path)
            with self._lock:
                if error is None:
                    self._undeleted.pop(path, None)
                else:
                    self._undeleted[path] = tag
                    errors.append(error)
        if errors:
            logger.warning("disk tier: %d block files of an erased cache could not be deleted (%s); they are not "
                           "served, and deleted when the folder lets them go", len(errors), errors[0])
        return len(paths) - len(errors), len(errors)

    def retry_deletes(self) -> None:
        """Deletes the files erases could not (their folder may let them go now); cheap while there are none."""
        if not self._undeleted:
            return
        with self._lock:  # (held throughout: a queued write of the same block replaces its file, then keeps it)
            for path in list(self._undeleted):
                if path.parent == self.dir and BlockHash(bytes.fromhex(path.stem)) in self._pending:
                    continue
                if _unlink(path) is None:
                    self._undeleted.pop(path, None)

    @property
    def pins_path(self) -> Path:
        return self.dir / "pins.json"

    def save_pins(self, records: list[dict]) -> None:
        """Writes the pinned prefixes for the next start (atomically); a failure only loses them, with a warning."""
        _save_pins(self.pins_path, records)

    def load_pins(self) -> list[dict]:
        """The pinned prefixes saved by the last run ([] if none, or if the file is unreadable)."""
        return _load_pins(self.pins_path)

    # ---- index and writer

    def _path(self, block_hash: BlockHash) -> Path:
        return self.dir / f"{block_hash.hex()}.kv"

    def _index_others(self, root: Path) -> None:
        """Files of other fingerprints (another model, dtype or block size): never read, counted against the
        one cap, and deleted first when it is reached."""
        entries = []
        for folder in os.scandir(root):
            if not folder.is_dir() or folder.path == str(self.dir) or not _FINGERPRINT_FOLDER.fullmatch(folder.name):
                continue
            for entry in os.scandir(folder.path):
                if not entry.name.endswith((".kv", ".tmp")):  # only what a tier wrote is ever deleted
                    continue
                try:
                    info = entry.stat()
                except OSError:
                    continue
                entries.append((info.st_mtime_ns, Path(entry.path), info.st_size))
        for _, path, size in sorted(entries):
            self._others.append((path, size))
            self._others_bytes += size

    def _build_index(self) -> None:
        """Names and sizes only: no KV is read until a hit."""
        entries = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.endswith(".tmp"):  # a write cut short by a crash
                _unlink(Path(entry.path))
                continue
            try:
                block_hash = BlockHash(bytes.fromhex(name.removesuffix(".kv")))
                if not entry.is_file():  # (what the tier writes: another kind of file is never read)
                    continue
                info = entry.stat()
            except (ValueError, OSError):
                continue
            entries.append((info.st_mtime_ns, block_hash, info.st_size))
        with self._lock:
            for _, block_hash, size in sorted(entries):
                self._add(block_hash, size)
            self._trim()

    def _write_loop(self) -> None:
        while (block_hash := self._queue.get()) is not None:
            try:
                if time.monotonic() < self._backoff_until:  # queued before the disk filled up: dropped
                    with self._lock:
                        self._drop_pending(block_hash)
                        self.stats.dropped_spills += 1
                else:
                    self._write(block_hash)
            except Exception:  # anything else loses this block, never the engine
                logger.exception("disk tier: writing a block failed")
                with self._lock:
                    self._drop_pending(block_hash)
                    self.stats.write_errors["io"] = self.stats.write_errors.get("io", 0) + 1
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, block_hash: BlockHash) -> None:
        pending = self._pending[block_hash]
        data = encode_block(self.fingerprint, block_hash, pending.token_ids, pending.kv, pending.owner)
        path = self._path(block_hash)
        error = _write_atomically(path, data)
        if error is not None and _error_reason(error) == "no_space" and self._make_room(len(data)):
            error = _write_atomically(path, data)
        if error is not None:
            with self._lock:
                self._drop_pending(block_hash)
                self._write_failed(error)
            return
        with self._lock:
            self._drop_pending(block_hash)
            self._add(block_hash, len(data))
            self._undeleted.pop(path, None)  # written anew since an erase failed to delete it: a file to keep
            self.stats.writes += 1
            self._backoff_s = 0.0
            self._trim()

    def _make_room(self, size: int) -> bool:
        """The disk is full below the cap: the folder's least recently used files (other configurations' first)
        deleted until `size` bytes went, so the newest blocks keep being written; False where none is left."""
        freed = 0
        with self._lock:
            while freed < size and (self._others or self._index):
                if self._others:
                    path, bytes_ = self._others.popleft()
                    self._others_bytes -= bytes_
                    _unlink(path)
                else:
                    block_hash = next(iter(self._index))
                    bytes_ = self._index[block_hash]
                    self._forget(block_hash)
                    self.stats.evictions += 1
                freed += bytes_
            if freed and not self._full_disk_said:
                self._full_disk_said = True
                logger.warning("disk tier: the disk under %s is full below the tier's cap (%d MB); its oldest blocks "
                               "make room for new ones", self.dir, self.max_bytes // 10**6)
        return freed > 0

    def _write_failed(self, exc: OSError) -> None:
        """Counts the error by reason and stops taking spills for a while (doubling while it lasts)."""
        reason = _error_reason(exc)
        self.stats.write_errors[reason] = self.stats.write_errors.get(reason, 0) + 1
        self._backoff_s = min(BACKOFF_S[1], self._backoff_s * 2 or BACKOFF_S[0])
        self._backoff_until = time.monotonic() + self._backoff_s
        logger.warning("disk tier: a block write failed (%s: %s); no spills for %.0f s", reason, exc.strerror,
                       self._backoff_s)

    def _drop_pending(self, block_hash: BlockHash) -> None:
        pending = self._pending.pop(block_hash)
        self._pending_bytes -= pending.kv.numel() * pending.kv.element_size()

    def _add(self, block_hash: BlockHash, size: int) -> None:
        self._index[block_hash] = size
        self._index_bytes += size

    def _trim(self) -> None:
        """One cap for the whole folder: other fingerprints' files go first, then this one's LRU."""
        while self._index_bytes + self._others_bytes > self.max_bytes and self._others:
            path, size = self._others.popleft()
            self._others_bytes -= size
            _unlink(path)
        while self._index_bytes > self.max_bytes and self._index:
            self._forget(next(iter(self._index)))
            self.stats.evictions += 1

    def _forget(self, block_hash: BlockHash) -> None:
        """Out of the index; the file is deleted if the folder allows (else it only stays behind)."""
        self._unindex(block_hash)
        _unlink(self._path(block_hash))

    def _unindex(self, block_hash: BlockHash) -> None:
        self._index_bytes -= self._index.pop(block_hash, 0)
