"""bench.perplexity's scoring on the tiny model: llama-perplexity's method, the engine's model against
transformers' forward of the same weights."""
from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM

from bench import perplexity
from engine.config import EngineConfig
from engine.core import EngineCore


def test_a_chunk_scores_its_second_half_as_transformers_does(tiny_llama_dir):
    core = EngineCore(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=8, enable_prefix_caching=False))
    ids = [(7 * i + 3) % (core.vocab_size - 1) + 1 for i in range(64)]
    nll, scored = perplexity.chunk_nll(core, ids)
    assert scored == 31  # positions 32..62 predict tokens 33..63
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    expected = -sum(logprobs[j, ids[j + 1]].item() for j in range(32, 63))
    assert math.isclose(nll, expected, rel_tol=1e-5)


def test_perplexity_over_whole_chunks_only(tiny_llama_dir):
    text = " ".join(f"word{i % 37} and more text" for i in range(200))
    result = perplexity.ours(str(tiny_llama_dir), "none", text, 64)
    core = EngineCore(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=8))
    tokens = core.tokenizer.encode(text)
    assert result["tokens"] == len(tokens) and result["chunks"] == len(tokens) // 64
    total = sum(perplexity.chunk_nll(core, tokens[s:s + 64])[0] for s in range(0, result["chunks"] * 64, 64))
    assert math.isclose(result["ppl"], math.exp(total / (31 * result["chunks"])), rel_tol=1e-6)
    assert result["weights"] == "none"


def test_llama_perplexitys_final_estimate_is_read_from_its_log(tmp_path):
    binary = tmp_path / "llama-perplexity"
    binary.write_text("#!/bin/sh\necho 'perplexity: calculating perplexity over 14 chunks, n_ctx=512' >&2\n"
                      "echo 'Final estimate: PPL = 18.2992 +/- 0.85944' >&2\n")
    binary.chmod(0o755)
    assert perplexity.llama(str(binary), "model.gguf", "text.txt", 512, 2) == {"ppl": 18.2992, "chunks": 14}
