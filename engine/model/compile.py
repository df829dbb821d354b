"""`python -m engine.model.compile [--model M]`: compiles the CPU kernels ahead of time into numba's cache
(engine/model/kernel_cache.py), so that a server's first request, or a container's (deploy/Dockerfile
runs this), does not wait for the compiler.

It runs the engine once on a few short prompts, a batch of them and one alone, with and without a shared
prefix, which reaches every kernel signature serving uses for the model's dtype (and, for quantized weights,
its activations: `--quantized-activations int8` compiles the integer kernels' path, which a float-path server
never compiles). numba keys cached code by the CPU as well: a machine of another kind compiles again on its
first request.
"""
from __future__ import annotations

import argparse
import sys
import time


def compile_kernels(model: str = "default", dtype: str = "auto", kv_cache_dtype: str = "auto",
                    quantized_activations: str = "float32") -> float:
    """Seconds it took (compiling, or loading what an earlier run compiled)."""
    from engine.llm import LLM
    from engine.model.kernel_cache import folder
    from engine.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantized_activations=quantized_activations,
              block_size=16, num_kv_blocks=64, max_model_len=512, threads=1, threads_batch=1)
    shared = list(range(100, 140))
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([shared + [7, 8], shared + [9, 10, 11], [5, 6, 7]], greedy)  # a batch: cascade attention
    llm.generate([12, 13, 14], greedy)  # one request alone
    print(f"kernels ready in {folder()}", file=sys.stderr)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.model.compile", description=__doc__)
    parser.add_argument("--model", default="default", help="model path, or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: as `serve` runs the model (a GGUF file's own formats, bf16 K/V beside them)")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                        help="the K/V cache's dtypes to compile for, one engine each (auto: as `serve` runs it)")
    parser.add_argument("--quantized-activations", default="float32", choices=["float32", "int8"],
                        help="as `serve --quantized-activations`: int8 compiles the integer dot products' path")
    args = parser.parse_args(argv)
    for kv_cache_dtype in args.kv_cache_dtype:
        seconds = compile_kernels(args.model, args.dtype, kv_cache_dtype, args.quantized_activations)
        print(f"compiled in {seconds:.1f} s (--dtype {args.dtype} --kv-cache-dtype {kv_cache_dtype} "
              f"--quantized-activations {args.quantized_activations})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
