"""Fault injection on the disk tier, as an operator meets faults: changed weights, corrupt, torn and zeroed
files, folders that refuse writes or deletes, a full disk, leftovers of other configurations, two servers
on one folder, and the file order a restart keeps. Each fault costs at most a cache miss: the answers equal
a run without the disk tier, and the cached-token counts say what was (not) served from disk.

Running as root, permissions cannot be taken away with chmod; those faults are injected where the tier
calls the OS (os.unlink, the block write), with the errors the OS raises."""
from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.kv import disk_tier
from engine.kv.disk_tier import DiskTier, encode_block, model_fingerprint
from engine.kv.hashing import hash_full_blocks
from tests.engine.kv.test_disk_tier import BS, FP, HOT, SHAPE, evict_hot, greedy, h, kv, make_llm, make_tier

TOKENS = 4  # generated per request


@pytest.fixture(scope="module")
def expected(tiny_llama_dir) -> list[int]:
    """HOT's greedy answer without a disk tier."""
    return LLM(str(tiny_llama_dir), num_kv_blocks=12).generate(HOT, greedy(TOKENS))[0].token_ids


def block_files(llm: LLM) -> list[Path]:
    return sorted(llm.core.kv.disk.dir.glob("*.kv"))


def spilled(model_dir, disk_dir) -> LLM:
    """An engine whose HOT blocks were computed, then evicted to disk."""
    llm = make_llm(model_dir, disk_dir)
    llm.generate(HOT, greedy(TOKENS))
    evict_hot(llm)
    return llm


def deny(monkeypatch, name: str, code: int = errno.EACCES, calls: list | None = None):
    """Makes disk_tier's os.<name> fail as an unwritable or immutable folder makes it fail."""
    def refuse(*args, **kwargs):
        if calls is not None:
            calls.append(args)
        raise OSError(code, os.strerror(code), str(args[0]) if args else None)
    monkeypatch.setattr(disk_tier.os, name, refuse)


# ---- stale KV

def test_a_same_size_weight_change_never_serves_the_old_blocks(tiny_llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    llm = make_llm(model, tmp_path / "kv")
    llm.generate(HOT, greedy(TOKENS))
    llm.close()
    weights = next(model.glob("*.safetensors"))
    size = weights.stat().st_size
    with weights.open("r+b") as f:  # a "fine-tune": the last weight's bytes change, far from the middle
        f.seek(size - 64)
        data = f.read(64)
        f.seek(size - 64)
        f.write(bytes(b ^ 0x40 for b in data))
    assert weights.stat().st_size == size
    changed = make_llm(model, tmp_path / "kv")
    out = changed.generate(HOT, greedy(TOKENS))[0]
    assert out.num_cached_tokens == 0 and changed.stats().disk_hits == 0
    assert out.token_ids == LLM(str(model), num_kv_blocks=12).generate(HOT, greedy(TOKENS))[0].token_ids
    changed.close()


def test_the_fingerprint_covers_every_byte_of_the_weights(tiny_llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    args = (torch.float32, BS, SHAPE, "sha256")
    before = model_fingerprint(model, *args)
    weights = next(model.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert model_fingerprint(model, *args) != before


# ---- bad files

@pytest.mark.parametrize("damage", ["truncated", "zeroed", "torn"])
def test_a_damaged_file_is_a_miss_from_that_block_on(tiny_llama_dir, tmp_path, expected, damage):
    llm = spilled(tiny_llama_dir, tmp_path)
    second = llm.core.kv.disk.dir / f"{hash_full_blocks(HOT, BS)[1].hex()}.kv"
    data = second.read_bytes()
    second.write_bytes({"truncated": data[:-100], "zeroed": bytes(len(data)),
                        "torn": data[:len(data) // 2] + bytes(len(data) - len(data) // 2)}[damage])
    out = llm.generate(HOT, greedy(TOKENS))[0]
    assert out.token_ids == expected and out.num_cached_tokens == BS  # block 0 from disk, the rest computed
    assert llm.stats().disk.corrupt == 1 and not second.exists()
    llm.close()


def test_a_bad_file_in_a_folder_that_refuses_deletes_costs_a_miss_not_the_step(tiny_llama_dir, tmp_path, expected,
                                                                               monkeypatch):
    llm = spilled(tiny_llama_dir, tmp_path)
    first = llm.core.kv.disk.dir / f"{hash_full_blocks(HOT, BS)[0].hex()}.kv"
    first.write_bytes(b"not a block")
    deny(monkeypatch, "unlink")
    out = llm.generate(HOT, greedy(TOKENS))[0]
    assert out.token_ids == expected and out.num_cached_tokens == 0
    assert first.exists() and llm.stats().disk.corrupt == 1  # left behind, never served again
    assert llm.generate(HOT, greedy(TOKENS))[0].token_ids == expected
    monkeypatch.undo()
    llm.close()


# ---- folders the tier cannot use

def test_a_folder_that_refuses_writes_starts_without_the_tier(tiny_llama_dir, tmp_path, expected, monkeypatch,
                                                              caplog):
    llm = make_llm(tiny_llama_dir, tmp_path)
    llm.generate(HOT, greedy(TOKENS))
    llm.close()
    (llm.core.kv.disk.dir / "leftover.tmp").write_bytes(b"half a block")
    deny(monkeypatch, "unlink")
    monkeypatch.setattr(disk_tier, "_probe_writable", lambda folder: (_ for _ in ()).throw(
        PermissionError(errno.EPERM, "Operation not permitted", str(folder))))
    with caplog.at_level(logging.WARNING, "prefixgate.engine"):
        again = make_llm(tiny_llama_dir, tmp_path)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "disk tier" in r.getMessage()]
    assert len(warnings) == 1 and "runs without it" in warnings[0].getMessage()
    assert again.core.kv.disk is None and again.stats().disk is None
    assert again.generate(HOT, greedy(TOKENS))[0].token_ids == expected


def test_a_disk_tier_path_that_is_a_file_starts_without_the_tier(tiny_llama_dir, tmp_path, expected):
    not_a_folder = tmp_path / "kv"
    not_a_folder.write_text("")
    llm = make_llm(tiny_llama_dir, not_a_folder)
    assert llm.core.kv.disk is None
    assert llm.generate(HOT, greedy(TOKENS))[0].token_ids == expected


def test_leftover_temporaries_of_a_killed_writer_are_removed_at_start(tmp_path):
    tier = make_tier(tmp_path)
    (tier.dir / f"{h(9).hex()}.tmp").write_bytes(b"cut short by kill -9")
    tier.close()
    again = make_tier(tmp_path)
    assert not list(again.dir.glob("*.tmp")) and h(9) not in again
    again.close()


def test_a_second_server_on_the_folder_is_refused_with_a_clear_message(tmp_path, caplog):
    first = make_tier(tmp_path)
    with caplog.at_level(logging.WARNING, "prefixgate.engine"):
        assert disk_tier.open_disk_tier(tmp_path, 2**30, FP, SHAPE, torch.float32) is None
    assert f"in use by another server (pid {os.getpid()})" in caplog.text and "--kv-disk-dir" in caplog.text
    first.put(h(1), (1, 2), kv(1))  # the first one is untouched
    first.close()
    second = make_tier(tmp_path)  # free again once the first closed
    assert h(1) in second
    second.close()


# ---- a full disk

def test_a_full_disk_loses_blocks_never_requests_and_leaves_no_temporaries(tiny_llama_dir, tmp_path, expected,
                                                                           monkeypatch, caplog):
    def full(path: Path, data: bytes) -> int:
        with open(path, "wb") as f:
            f.write(data[:len(data) // 3])  # part of it fit
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(Path, "write_bytes", full)
    llm = spilled(tiny_llama_dir, tmp_path)
    disk = llm.core.kv.disk
    disk.flush()
    stats = llm.stats().disk
    assert stats.writes == 0 and stats.write_errors == {"no_space": 1}  # one try, then the writer backs off
    assert stats.dropped_spills > 0 and not list(disk.dir.iterdir())  # no temporary left behind
    out = llm.generate(HOT, greedy(TOKENS))[0]
    assert out.token_ids == expected and out.num_cached_tokens == 0
    with caplog.at_level(logging.INFO, "prefixgate.engine"):
        llm.close()
    assert "could not be written" in caplog.text and "wrote" not in caplog.text
    assert not list(disk.dir.iterdir())


def test_writes_resume_after_the_backoff(tmp_path, monkeypatch):
    tier = make_tier(tmp_path)
    real = Path.write_bytes
    failures = [OSError(errno.ENOSPC, "No space left on device")]

    def once_full(path: Path, data: bytes) -> int:
        if failures:
            raise failures.pop()
        return real(path, data)

    monkeypatch.setattr(Path, "write_bytes", once_full)
    assert tier.put(h(1), (1, 2), kv(1))
    tier.flush()
    assert not tier.put(h(2), (1, 2), kv(2))  # backing off: refused at once
    tier._backoff_until = 0.0  # (the 1 s backoff, elapsed)
    assert tier.put(h(3), (1, 2), kv(3))
    tier.flush()
    stats = tier.snapshot()
    assert stats.write_errors == {"no_space": 1} and stats.dropped_spills == 1 and stats.writes == 1
    assert h(3) in tier and h(1) not in tier
    tier.close()


def test_a_disk_full_below_the_cap_makes_room_by_deleting_the_oldest_blocks(tmp_path, monkeypatch, caplog):
    """A disk that holds two block files: the third write deletes the oldest and is written; no backoff, so the
    cache keeps its newest blocks where it kept its oldest (and refused every new one for a while)."""
    real = Path.write_bytes

    def two_fit(path: Path, data: bytes) -> int:
        if len(list(path.parent.glob("*.kv"))) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    tier = make_tier(tmp_path)  # a cap of 1 GiB: the disk is what fills
    monkeypatch.setattr(Path, "write_bytes", two_fit)
    with caplog.at_level(logging.WARNING, "prefixgate.engine"):
        for n in range(1, 5):
            assert tier.put(h(n), (1, 2), kv(n))  # never backing off
            tier.flush()
    assert [h(n) in tier for n in range(1, 5)] == [False, False, True, True]
    assert torch.equal(tier.load(h(4), (1, 2))[0], kv(4))
    stats = tier.snapshot()
    assert (stats.writes, stats.write_errors, stats.evictions, stats.files) == (4, {}, 2, 2)
    assert caplog.text.count("full below the tier's cap") == 1
    tier.close()


# ---- one cap for the folder

def test_other_configurations_files_count_against_the_cap_and_go_first(tmp_path):
    size = len(encode_block(FP, h(0), (1, 2), kv(0)))
    old = DiskTier(tmp_path, 2**30, bytes(32), SHAPE, torch.float32)  # another model / dtype / block size
    for n in range(3):
        old.put(h(n), (1, 2), kv(n))
    old.close()
    tier = make_tier(tmp_path, max_bytes=3 * size)
    for n in range(10, 13):
        tier.put(h(n), (1, 2), kv(n))
    tier.flush()
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*.kv"))
    assert on_disk <= 3 * size and not list(old.dir.glob("*.kv"))  # the old configuration's files went first
    assert all(h(n) in tier for n in range(10, 13)) and tier.snapshot().evictions == 0
    tier.close()


def test_the_cap_never_deletes_what_a_tier_did_not_write(tmp_path):
    size = len(encode_block(FP, h(0), (1, 2), kv(0)))
    mine = tmp_path / "notes" / "keep.txt"  # an operator's file beside the tier's folders
    mine.parent.mkdir()
    mine.write_bytes(bytes(10 * size))
    tier = make_tier(tmp_path, max_bytes=2 * size)
    tier.put(h(1), (1, 2), kv(1))
    tier.flush()
    assert mine.exists() and h(1) in tier
    tier.close()


# ---- recency across a restart

def test_a_block_served_from_disk_outlives_older_ones_after_a_restart(tmp_path):
    size = len(encode_block(FP, h(0), (1, 2), kv(0)))
    tier = make_tier(tmp_path)
    for n in range(3):
        tier.put(h(n), (1, 2), kv(n))
        tier.flush()
        os.utime(tier.dir / f"{h(n).hex()}.kv", ns=(n * 10**9, n * 10**9))  # written a second apart, h(0) oldest
    assert tier.load(h(0), (1, 2)) is not None  # a hit: h(0) is now the most recently used
    tier.close()
    again = make_tier(tmp_path, max_bytes=2 * size)  # a smaller cap after the restart drops one file
    assert [h(n) in again for n in range(3)] == [True, False, True]
    again.close()


def test_a_graceful_shutdown_keeps_ram_recency_in_the_file_times(tiny_llama_dir, tmp_path):
    llm = spilled(tiny_llama_dir, tmp_path)
    llm.core.kv.disk.flush()
    for path in block_files(llm):
        os.utime(path, ns=(0, 0))  # long ago
    out = llm.generate(HOT, greedy(TOKENS))[0]  # HOT comes back from disk into RAM...
    assert out.num_cached_tokens == 4 * BS
    llm.close()  # ...and the shutdown marks its files used now
    hot = {f"{hh.hex()}.kv" for hh in hash_full_blocks(HOT, BS)}
    times = {p.name: p.stat().st_mtime_ns for p in block_files(llm)}
    assert min(times[name] for name in hot) > max(t for name, t in times.items() if name not in hot)
