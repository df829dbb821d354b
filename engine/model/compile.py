"""`python -m engine.model.compile [--model M]`: compiles the CPU kernels ahead of time into numba's cache
(engine/model/kernel_cache.py), so that a server's first request, or a container's (deploy/Dockerfile
runs this), does not wait for the compiler.

It runs the engine once on a few short prompts, a batch of them and one alone, with and without a shared
prefix, which reaches every kernel signature serving uses for the model's dtype (and, for quantized weights,
its activations: `--quantized-activations int8` compiles the integer kernels' path, which a float-path server
never compiles). numba keys cached code by the CPU as well: a machine of another kind compiles again on its
first request.

A server's first start compiles in two processes (start_prefill_compile): numba compiles on one core, and the
kernels of steps with a prefill chunk (the paged decode attention of their decode rows, the prefill's matmuls)
do not depend on the compiled decode step, so a second process (`--prefill-only`) compiles them meanwhile.
"""
from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("prefixgate.engine")

# the second process loads the model as well: it starts only where memory holds the model's files this many
# times over, and this much beside
MEMORY_FACTOR = 2
MEMORY_MARGIN = 1 << 30
DTYPES = ("auto", "float32", "bfloat16")  # those the CPU kernels compile for
WAIT_S = 600.0  # a second process not done by then (it takes about 30 s on 2 cores) is stopped; this one compiles


def compile_kernels(model: str = "default", dtype: str = "auto", kv_cache_dtype: str = "auto",
                    quantized_activations: str = "float32", quantization: str = "auto") -> float:
    """Seconds it took (compiling, or loading what an earlier run compiled)."""
    from engine.llm import LLM
    from engine.model.kernel_cache import folder
    from engine.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantized_activations=quantized_activations,
              quantization=quantization, block_size=16, num_kv_blocks=64, max_model_len=512, threads=1,
              threads_batch=1)
    shared = list(range(100, 140))
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([shared + [7, 8], shared + [9, 10, 11], [5, 6, 7]], greedy)  # a batch: cascade attention
    llm.generate([12, 13, 14], greedy)  # one request alone
    print(f"kernels ready in {folder()}", file=sys.stderr)
    return time.perf_counter() - start


def compile_prefill_kernels(model: str, dtype: str, kv_cache_dtype: str, quantized_activations: str,
                            quantization: str) -> float:
    """The kernels a start-up's probe of a step with a prefill chunk runs (engine/threads.py), and no compiled
    decode step: what a first start's second process compiles. Seconds it took."""
    from engine.config import EngineConfig
    from engine.core import EngineCore

    start = time.perf_counter()
    core = EngineCore(EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                                   quantized_activations=quantized_activations, block_size=16, num_kv_blocks=64,
                                   max_model_len=512, threads=1, threads_batch=1), decode_step=False)
    core.runner.calibration_step(128, 1)
    core.close()
    return time.perf_counter() - start


class PrefillCompile:
    """The second process of a first start (start_prefill_compile); wait() before the first step with a prefill
    chunk, so that it loads what the second process compiled rather than compiling it again."""

    def __init__(self, process: subprocess.Popen, log) -> None:
        self.process, self.log = process, log

    def wait(self) -> bool:
        """Whether it compiled them (else this process compiles them, as without it)."""
        try:
            returncode = self.process.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            returncode = self.process.wait()
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace").strip().splitlines()[-5:]
        self.log.close()
        if returncode != 0:
            logger.warning("the second process compiling the prefill's kernels failed (exit %d): compiling them here; "
                           "its last lines: %s", returncode, " | ".join(tail))
            return False
        logger.info("the prefill's kernels came from the second process: %s", tail[-1] if tail else "no output")
        return True


def start_prefill_compile(config, model_path: Path) -> PrefillCompile | None:
    """On a first start (numba's cache folder has no paged decode attention yet), with two cores or more and the
    memory for a second copy of the model: a second process compiling the kernels of steps with a prefill chunk
    while this one compiles the decode step. None where that does not apply."""
    from engine.model import kernel_cache
    from engine.threads import usable_cores

    if not kernel_cache.CACHE or usable_cores() < 2 or kernel_cache.has_compiled("paged_decode_cpu.attend"):
        return None
    if config.dtype not in DTYPES or config.kv_cache_dtype not in DTYPES:  # float16: no CPU kernel compiles for it
        return None
    if _available_memory() < MEMORY_FACTOR * _model_bytes(model_path) + MEMORY_MARGIN:
        return None
    command = [sys.executable, "-m", "engine.model.compile", "--prefill-only", "--model", str(model_path),
               "--dtype", config.dtype, "--kv-cache-dtype", config.kv_cache_dtype,
               "--quantized-activations", config.quantized_activations, "--quantization", config.quantization]
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    logger.info("first start: compiling the prefill's kernels in a second process (pid %d) while this one compiles "
                "the decode step", process.pid)
    return PrefillCompile(process, log)


def _model_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _available_memory() -> int:
    """MemAvailable (Linux); elsewhere unknown, taken as enough."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.model.compile", description=__doc__)
    parser.add_argument("--model", default="default", help="model path, or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="auto: as `serve` runs the model (a GGUF file's own formats, bf16 K/V beside them)")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=DTYPES,
                        help="the K/V cache's dtypes to compile for, one engine each (auto: as `serve` runs it)")
    parser.add_argument("--quantized-activations", default="float32", choices=["float32", "int8"],
                        help="as `serve --quantized-activations`: int8 compiles the integer dot products' path")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "q8_0", "q4_0"],
                        help="as `serve --quantization`: q8_0 / q4_0 quantize a float checkpoint at load")
    parser.add_argument("--prefill-only", action="store_true",
                        help="only the kernels of steps with a prefill chunk (a first start's second process)")
    args = parser.parse_args(argv)
    if args.prefill_only:
        from engine.engine_process import _die_with_parent
        _die_with_parent()  # a second process of a start-up that failed or was stopped ends with it
        logging.basicConfig(level=logging.WARNING)
    for kv_cache_dtype in args.kv_cache_dtype:
        if args.prefill_only:
            seconds = compile_prefill_kernels(args.model, args.dtype, kv_cache_dtype, args.quantized_activations,
                                              args.quantization)
        else:
            seconds = compile_kernels(args.model, args.dtype, kv_cache_dtype, args.quantized_activations,
                                      args.quantization)
        print(f"compiled in {seconds:.1f} s (--dtype {args.dtype} --kv-cache-dtype {kv_cache_dtype} "
              f"--quantized-activations {args.quantized_activations}{' --prefill-only' * args.prefill_only})",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
