"""The memory a model's load peaks at, and what it holds once loaded: `python scripts/load_peak.py MODEL [DTYPE]`
(MODEL: a GGUF file, an HF directory or `default`; DTYPE: the engine's --dtype, auto by default). Peaks are
sampled from /proc/self/status every 2 ms: anonymous pages (what the load itself allocates) apart from the
mapped file's pages, which the kernel takes back under pressure. docs/quantization.md has its figures."""
from __future__ import annotations

import gc
import sys
import threading
import time

FIELDS = ("VmRSS", "RssAnon", "RssFile")


def status() -> dict[str, float]:
    """This process's resident memory in MiB: all of it, anonymous, file-backed."""
    with open("/proc/self/status") as f:
        pairs = (line.split(":", 1) for line in f)
        return {key: int(value.split()[0]) / 1024 for key, value in pairs if key in FIELDS}


def main(model: str, dtype: str = "auto") -> None:
    from engine import LLM

    peaks = dict.fromkeys(FIELDS, 0.0)
    loading = True

    def sample() -> None:
        while loading:
            for key, value in status().items():
                peaks[key] = max(peaks[key], value)
            time.sleep(0.002)

    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    llm = LLM(model, dtype=dtype, block_size=16, num_kv_blocks=64, threads=1, threads_batch=1)
    loading = False
    seconds = time.perf_counter() - start
    gc.collect()
    after = status()
    print(f"{model} ({dtype}, {llm.core.weights_format}): load {seconds:.1f} s; peak RSS {peaks['VmRSS']:.0f} MiB "
          f"(anonymous {peaks['RssAnon']:.0f}, file {peaks['RssFile']:.0f}); after the load {after['VmRSS']:.0f} "
          f"(anonymous {after['RssAnon']:.0f}, file {after['RssFile']:.0f})")


if __name__ == "__main__":
    main(*sys.argv[1:3])
