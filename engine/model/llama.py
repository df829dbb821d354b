"""A compact Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat token batch.

Module names mirror Hugging Face's, except the fused projections (qkv_proj, gate_up_proj) that
the loader builds from the checkpoint's separate ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.model.attention import AttentionMetadata, paged_attention, store_kv
from engine.model.linear import Embedding, Linear

if TYPE_CHECKING:
    from engine.model.model_config import AnyConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def head_dim(config: AnyConfig) -> int:
    """Size of one attention head: the config's own where it names one (Qwen3), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from engine.model import fused_cuda  # (Triton: imported only where CUDA runs)
            return fused_cuda.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, delta: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta): the residual add before a norm, one kernel on CUDA (which
        adds into `residual` in place)."""
        if residual.is_cuda:
            from engine.model import fused_cuda
            return fused_cuda.add_rms_norm(delta, residual, self.weight, self.eps), residual
        residual = residual + delta
        return self(residual), residual


class RotaryEmbedding(nn.Module):
    def __init__(self, config: AnyConfig, head_dim: int) -> None:
        super().__init__()
        params = config.rope_parameters or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
            self.attention_scaling = 1.0
            factors = getattr(config, "rope_freq_factors", None)  # (a GGUF's llama 3 scaling, as llama.cpp applies it)
            if factors:
                inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float)
        else:
            # "dynamic" gets its static frequencies: exact up to the original context length
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # (their configs come from transformers)
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: AnyConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        qkv_bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v in one matmul (the loader concatenates the checkpoint's three weights)
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden,
                             bias=getattr(config, "attention_bias", False) and config.model_type != "qwen2")
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if x.is_cuda:  # rotary on q and k and the K/V store in one kernel
            from engine.model import fused_cuda
            q = fused_cuda.rotary_and_store(q, k, v, cos, sin, meta.slot_mapping, k_cache, v_cache)
        else:
            q = apply_rotary(q, cos, sin)
            store_kv(apply_rotary(k, cos, sin), v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, config: AnyConfig) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        # gate and up in one matmul (the loader concatenates the checkpoint's two weights)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from engine.model import fused_cuda
            return self.down_proj(fused_cuda.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        # in place, into the projection's own output: fresh [tokens, intermediate] buffers for silu and the
        # product cost page faults on every prefill step (docs/speed.md#prefill)
        return self.down_proj(nn.functional.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: AnyConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last layer's output (the embeddings, with residual None, for the first). Returns (this layer's
        output, the residual stream before it): their sum, which the next norm adds, is the stream after it."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x, residual = self.post_attention_layernorm.add_and_norm(
            self.self_attn(x, cos, sin, k_cache, v_cache, meta), residual)
        return self.mlp(x), residual


class Backbone(nn.Module):
    def __init__(self, config: AnyConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim(config))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: AnyConfig) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model type {config.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        self.config = config
        self.model = Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """kv_cache: [2, layers, num_slots, KVH, D]. Returns logits of the rows in logits_indices, and with
        return_hidden their final (normed) hidden states too."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        residual = None
        for layer, k_cache, v_cache in zip(self.model.layers, kv_cache[0], kv_cache[1]):
            x, residual = layer(x, residual, cos, sin, k_cache, v_cache, meta)
        x, _ = self.model.norm.add_and_norm(x[logits_indices], residual[logits_indices])
        logits = self.lm_head(x).float()
        return (logits, x) if return_hidden else logits
