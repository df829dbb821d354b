"""Perplexity of weights quantized at load against llama.cpp's on the file its quantizer makes from the same
weights: `python -m bench.perplexity --model FP32_DIR --llama-perplexity BIN --llama-gguf q8_0=FILE ...`.

Both sides score the text the way `llama-perplexity` does: the tokens cut into chunks of `--ctx`, each chunk
evaluated from position 0, and the negative log-likelihood of the tokens of each chunk's second half (the
logits at position j predict token j + 1, for j from ctx/2 to ctx - 2). Ours runs the engine's model as it
serves (the quantized tiles and their kernels, `--quantization FORMAT` at load) over the K/V pool's slots.
Issue 42's bar: ours <= 1.02x llama.cpp's in each format. The F32 row of each side checks the two agree on
the tokens and the method before any quantization.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
from pathlib import Path

import torch

from bench.decode import blocks_per_sequence
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.attention import AttentionMetadata, PrefillSeq

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"  # held-out English prose on every Debian machine


def chunk_nll(core: EngineCore, ids: list[int]) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens scored) of one chunk evaluated from position 0."""
    n = len(ids)
    slots = torch.arange(n, device=core.device)
    meta = AttentionMetadata(slots, [PrefillSeq(0, n, slots, None)], None)
    first = n // 2
    rows = torch.arange(first, n - 1, device=core.device)
    logits = core.model(torch.tensor(ids, device=core.device), slots, core.runner.kv_slots, meta, rows)
    targets = torch.tensor(ids[first + 1:], device=core.device)
    logprobs = logits.double().log_softmax(-1)
    return -logprobs[torch.arange(len(rows)), targets].sum().item(), len(rows)


def ours(model: str, quantization: str, text: str, ctx: int) -> dict:
    core = EngineCore(EngineConfig(model=model, quantization=quantization, max_num_batched_tokens=ctx,
                                   num_kv_blocks=blocks_per_sequence(ctx, 0, {}) + 2, enable_prefix_caching=False))
    tokens = core.tokenizer.encode(text)
    total, count = 0.0, 0
    for start in range(0, len(tokens) - ctx + 1, ctx):
        nll, n = chunk_nll(core, tokens[start:start + ctx])
        total, count = total + nll, count + n
    return {"ppl": math.exp(total / count), "tokens": len(tokens), "chunks": len(tokens) // ctx,
            "weights": core.weights_format}


def llama(binary: str, gguf: str, text_file: str, ctx: int, threads: int) -> dict:
    out = subprocess.run([binary, "-m", gguf, "-f", text_file, "-c", str(ctx), "-t", str(threads)],
                         capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    ppl = float(re.search(r"Final estimate: PPL = ([\d.]+)", log).group(1))
    chunks = int(re.search(r"calculating perplexity over (\d+) chunks", log).group(1))
    return {"ppl": ppl, "chunks": chunks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perplexity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the float checkpoint (an HF safetensors directory)")
    parser.add_argument("--formats", default="q8_0,q4_0", help="formats to quantize at load")
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity (../shared/peers/)")
    parser.add_argument("--llama-gguf", action="append", default=[], metavar="FORMAT=FILE",
                        help="llama.cpp's file of a format from the same weights (f32=..., q8_0=..., q4_0=...)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    text = Path(args.text).read_text()
    files = dict(item.split("=", 1) for item in args.llama_gguf)
    result: dict = {"text": args.text, "ctx": args.ctx, "rows": {}}
    for fmt in ["none", *args.formats.split(",")]:
        row = {"ours": ours(args.model, fmt, text, args.ctx)}
        peer_file = files.get("f32" if fmt == "none" else fmt)
        if args.llama_perplexity and peer_file:
            row["llama.cpp"] = llama(args.llama_perplexity, peer_file, args.text, args.ctx, args.threads)
            row["ratio"] = row["ours"]["ppl"] / row["llama.cpp"]["ppl"]
        result["rows"][fmt] = row
        peer = row.get("llama.cpp")
        print(f"{'f32' if fmt == 'none' else fmt:6} ours {row['ours']['ppl']:.4f} ({row['ours']['chunks']} chunks)"
              + (f"  llama.cpp {peer['ppl']:.4f} ({peer['chunks']} chunks)  ratio {row['ratio']:.4f}" if peer else ""),
              flush=True)
    quantized = [row for fmt, row in result["rows"].items() if fmt != "none" and "ratio" in row]
    result["target_met"] = all(row["ratio"] <= 1.02 for row in quantized) if quantized else None
    if quantized:
        print(f"target: ours <= 1.02x llama.cpp in each format: {'met' if result['target_met'] else 'missed'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["target_met"] is not False else 1


if __name__ == "__main__":
    raise SystemExit(main())
