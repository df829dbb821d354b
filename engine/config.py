"""Engine settings: one frozen dataclass, checked once at start-up."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    LPM = "lpm"  # longest prefix match first (SGLang's `lpm`)


class HashAlgo(str, enum.Enum):
    SHA256 = "sha256"
    XXHASH = "xxhash"


class EvictionPolicy(str, enum.Enum):
    LRU = "lru"
    SLRU = "slru"  # segmented LRU: blocks hit again are protected from one-off prompts (adaptive share)


GATEWAY_SET = {"gateway_set": True}  # a field's metadata: the gateway fills it in, never a setting


def settable(field: dataclasses.Field) -> bool:
    """Whether a setting (a flag, a YAML key) sets the field."""
    return not field.metadata.get("gateway_set")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "default"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size the pool from kv_cache_memory_mb
    kv_cache_memory_mb: int = 1024
    max_num_batched_tokens: int = 512  # token budget of one step (the prefill chunk size)
    max_num_seqs: int = 32
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    hash_algo: HashAlgo = HashAlgo.SHA256
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.LPM
    max_reorder_wait_s: float = 2.0  # lpm may delay a request at most this long past FCFS
    lpm_max_queue: int = 2048  # above this many waiting requests lpm falls back to FCFS
    min_shared_prefix_tokens: int = 0  # side-channel hardening: no hit shorter than this
    max_step_ms: float | None = None  # step-time target: caps each step's prefill share (None: off)
    eviction_policy: EvictionPolicy = EvictionPolicy.SLRU  # slru (scan-resistant, adaptive; see bench tiers) | lru
    kv_disk_dir: str | None = None  # disk tier for evicted blocks (kept across restarts); None: no disk tier
    kv_disk_gb: float = 10.0  # disk tier size bound in GiB (its own LRU drops the oldest files)
    max_pinned_fraction: float = 0.5  # share of the KV pool that pinned prefixes (cache_control) may hold
    # saved pins a start restores: those made under this fingerprint of the salt secret, of these tenants (None:
    # any). The gateway sets both from its keys (no flag, no YAML key: GATEWAY_SET)
    salt_fingerprint: str | None = dataclasses.field(default=None, metadata=GATEWAY_SET)
    tenants: tuple[str, ...] | None = dataclasses.field(default=None, metadata=GATEWAY_SET)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA; a GGUF's weights in their formats) | float32 | bfloat16 | float16
    # auto (a GGUF file's own formats, CPU) | none (weights as dtype) | q8_0 | q4_0 (quantized at load, CPU)
    quantization: str = "auto"
    # CPU quantized matmuls: float32 (exact: the dequantized model to fp32 summation order) | int8 (llama.cpp's
    # way where the CPU has AVX2: activations rounded to int8 per group of 32, integer dot products; faster)
    quantized_activations: str = "float32"
    # K/V storage: auto (the model's dtype; bfloat16 beside quantized weights) | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False  # CUDA: launch every decode step's kernels one by one (no CUDA graphs)
    cpu_kernels: str = "compiled"  # CPU: compiled (numba kernels, packed weights) | eager (plain PyTorch, no numba)
    seed: int = 0
    threads: int | None = None  # CPU compute threads of decode-only steps; None: timed at start-up
    threads_batch: int | None = None  # CPU compute threads of steps with a prefill chunk; None: timed at start-up
    model_cache_dir: str | None = None  # where the default model is converted to

    def __post_init__(self) -> None:
        object.__setattr__(self, "hash_algo", HashAlgo(self.hash_algo))
        object.__setattr__(self, "scheduling_policy", SchedulingPolicy(self.scheduling_policy))
        object.__setattr__(self, "eviction_policy", EvictionPolicy(self.eviction_policy))
        _check(self.block_size >= 1, "block_size must be >= 1")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks must be >= 2")
        _check(self.kv_cache_memory_mb > 0, "kv_cache_memory_mb must be > 0")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        # a smaller budget could not give every running sequence its decode token: some would skip steps
        _check(self.max_num_batched_tokens >= self.max_num_seqs,
               f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        _check(self.max_reorder_wait_s >= 0, "max_reorder_wait_s must be >= 0")
        _check(self.min_shared_prefix_tokens >= 0, "min_shared_prefix_tokens must be >= 0")
        _check(self.kv_disk_gb > 0, "kv_disk_gb must be > 0")
        _check(0 <= self.max_pinned_fraction <= 1, "max_pinned_fraction must be in [0, 1]")
        _check(self.max_step_ms is None or self.max_step_ms > 0, "max_step_ms must be > 0")
        _check(self.device in ("auto", "cpu", "cuda"), f"unknown device {self.device!r}")
        _check(self.cpu_kernels in ("compiled", "eager"), f"unknown cpu_kernels {self.cpu_kernels!r}")
        _check(self.threads is None or self.threads >= 1, "threads must be >= 1")
        _check(self.threads_batch is None or self.threads_batch >= 1, "threads_batch must be >= 1")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), f"unknown dtype {self.dtype!r}")
        _check(self.quantization in ("auto", "none", "q8_0", "q4_0"), f"unknown quantization {self.quantization!r}")
        _check(self.quantized_activations in ("float32", "int8"),
               f"unknown quantized_activations {self.quantized_activations!r}")
        _check(self.kv_cache_dtype in ("auto", "float32", "bfloat16", "float16"),
               f"unknown kv_cache_dtype {self.kv_cache_dtype!r}")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
