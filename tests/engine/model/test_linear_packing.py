"""Packed linear weights (engine/model/packed_matmul_cpu.py) give the logits of the plain row-major weights, and
are the only copy of the weights kept (a tied embedding reads its rows out of the lm_head's tiles)."""
from __future__ import annotations

import torch

from engine.model.linear import Linear
from engine.model.loader import load_model
from engine.model.model_config import load_config


def test_packed_and_plain_weights_give_the_same_logits(tiny_llama_dir):
    config = load_config(tiny_llama_dir)
    packed = load_model(tiny_llama_dir, config, torch.float32, torch.device("cpu"))
    plain = load_model(tiny_llama_dir, config, torch.float32, torch.device("cpu"), pack=False)
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    assert all(m.packed is None for m in plain.modules() if isinstance(m, Linear))
    assert all(m.weight is None for m in linears)  # one copy: the packed one
    embedding = packed.model.embed_tokens
    assert config.tie_word_embeddings and embedding.weight is None and embedding.tiles is packed.lm_head.packed
    ids = torch.tensor([0, 1, 31, 32, 33, config.vocab_size - 1])
    torch.testing.assert_close(embedding(ids), plain.model.embed_tokens(ids), rtol=0, atol=0)
    for m_packed, m_plain in zip(linears, (m for m in plain.modules() if isinstance(m, Linear))):
        for rows in (5, 77):  # the packed kernel's small batches, and the batched matmul of prefill
            x = torch.randn(rows, m_plain.in_features)
            torch.testing.assert_close(m_packed(x), m_plain(x), rtol=1e-4, atol=1e-4)
    # the whole model: logits of a prefill longer than the packed kernel's batches
    from engine.model.attention import AttentionMetadata, PrefillSeq
    n = 40
    ids, positions = torch.randint(0, config.vocab_size, (n,)), torch.arange(n)
    head_dim = config.hidden_size // config.num_attention_heads
    logits = []
    for model in (packed, plain):
        kv = torch.zeros(2, config.num_hidden_layers, n, config.num_key_value_heads, head_dim)
        meta = AttentionMetadata(torch.arange(n), [PrefillSeq(0, n, torch.arange(n), None)], None)
        logits.append(model(ids, positions, kv, meta, torch.arange(n)))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
