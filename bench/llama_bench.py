"""llama.cpp's decode on the same GGUF file against the same roofline as ours: `python -m bench.decode --model
FILE.gguf --llama-bench BINARY` runs `llama-bench` (built by ../shared/peers/) at batch 1 from the same context, each
run right after a bandwidth probe, and divides the bytes a llama.cpp token reads by that probe's rate: one probe
for both engines, so a share of the roofline that neither reaches on a machine shows as the machine's, not ours.
Each engine's bytes are its own: on K-quant files our tiles hold about 4% more than the file (docs/speed.md,
"Tiles against the file's bytes"), so our ratio there reads that much higher than on the file's bytes.

llama.cpp's bytes a token: every tensor of the file once (a separate output matrix leaves the embedding to its
row lookups), and its K/V in 16 bits (llama-bench's default f16 cache) over the context and half the new tokens.
"""
from __future__ import annotations

import json
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

from engine.model.gguf_index import ArrayReader

RUN_TIMEOUT_S = 600
KV_BYTES = 2  # llama-bench's K/V cache types: f16


def step_weight_bytes(gguf: Path) -> int:
    """Bytes of the file's tensors a decode step reads: all of them, but for the token embedding where the file
    has its own output matrix (then a step reads only its tokens' rows)."""
    tensors = ArrayReader(gguf).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))


def decode_ms(binary: str, gguf: Path, context: int, tokens: int, threads: int) -> float:
    """One `llama-bench` run: the mean time of a decoded token after a `context`-token prompt (its prefill of the
    context comes before its clock starts), after llama-bench's own warm-up run."""
    command = [binary, "-m", str(gguf), "-p", "0", "-n", str(tokens), "-d", str(context), "-r", "1",
               "-t", str(threads), "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
    (record,) = json.loads(done.stdout)
    return record["avg_ns"] / record["n_gen"] / 1e6


def measure(binary: str, gguf: Path, probe_gb_s: Callable[[], float], context: int, tokens: int,
            kv_elements_per_token: int, threads: int, runs: int = 3) -> dict:
    """`runs` llama-bench runs, each after a probe: the median token time, and the median of each run against
    its own probe (as bench.decode takes our steps)."""
    weights = step_weight_bytes(gguf)
    kv = kv_elements_per_token * KV_BYTES * (context + tokens // 2)
    samples = []
    for _ in range(runs):
        bandwidth = probe_gb_s()
        samples.append((bandwidth, decode_ms(binary, gguf, context, tokens, threads)))
    return {"ms_per_token": statistics.median(ms for _, ms in samples),
            "bandwidth_gb_s": statistics.median(bw for bw, _ in samples),
            "weight_mb": weights / 1e6, "kv_mb": kv / 1e6, "threads": threads, "runs": runs,
            "roofline_ratio": statistics.median((weights + kv) / (bw * 1e9) / (ms / 1e3) for bw, ms in samples)}
