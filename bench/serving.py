"""The server at engine speed: `python -m bench serving`.

Runs, taking turns on one machine, the same work four ways and prints targets met / missed:
- in process: EngineCore stepped on this process's main thread (the engine's own speed);
- `serve` as users start it: the API process plus the engine process (the default);
- `serve --no-engine-process`: the engine on a thread of the API process (the shape before the split);
- llama.cpp's `llama-server` on the same weights, when `--llama-server` and `--llama-gguf` are given
  (../shared/peers/ builds it).
Each: one stream of `--tokens` tokens (inter-token gap p50) and bench.multiturn's 4 chats (decode ITL p50,
TTFT p50, output tok/s); each server's proportional set size (PSS) per process at idle and after its run.
The chats run twice: closed loop (each turn sent as its answer ends: output tok/s, against llama.cpp) and
paused (`--think-s` before each later turn, as a user reads and types: TTFT and ITL against in process, on other
text so the first run's cache does not serve it). Closed loop, the in-process driver adds a turn at the very step
boundary its answer ended, which no HTTP client can; a few milliseconds there move whole prefill steps between
TTFT and the other chats' gaps, so its TTFT measures arrival phase, not the serving path (docs/serving.md).
`--many-chats N` adds N closed-loop chats on one shared `--many-prefix-tokens` system prompt (TTFT and ITL p50/p99,
output tok/s); `--device cuda` runs the engine on the GPU in process and served (scripts/cuda_check.sh);
`--transformers` adds plain transformers' decode step on the same device.
Writes serving.json and serving.png under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from bench import multiturn
from bench.driver import run_engine, warm_up
from bench.workloads import Workload

REPO = Path(__file__).resolve().parent.parent
PAUSED_SEED = 13  # the paused chats' text differs from the closed-loop ones'
MANY_SEED = 14  # and the many chats' text differs from both
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
MB = 2**20


def pss_mb(pid: int) -> dict[str, float]:
    """The proportional set size of the process and each of its children, MB, as if they ran alone: a page
    shared among them counted once across them, a page they share with another process (this bench's own,
    which maps torch and numba too) counted whole. The kernel's PSS splits a page among every process that maps
    it, so with this process alive it read 57 MB low for `serve` on the default model."""
    root = psutil.Process(pid)
    maps: dict[str, list] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            maps[f"{proc.pid} {' '.join(proc.cmdline()[1:4])}"] = proc.memory_maps(grouped=True)
        except psutil.Error:
            continue
    sharers: dict[str, int] = {}  # a mapped file -> how many of the tree's processes map it
    for mappings in maps.values():
        for path in {m.path for m in mappings if m.path.startswith("/")}:
            sharers[path] = sharers.get(path, 0) + 1
    return {name: sum(m.private_clean + m.private_dirty + (m.shared_clean + m.shared_dirty) / sharers[m.path]
                      if m.path.startswith("/") else m.pss for m in mappings) / MB
            for name, mappings in maps.items()}


# ---- in process

def in_process(model: str, tokens: int, turns: int, think_s: float, engine: dict, many: dict) -> dict:
    """`engine`: EngineConfig fields the servers get as flags too; `many`: bench.multiturn.workload's arguments
    of the many-chats workload (empty: none)."""
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.model.loader import resolve_model_path
    from engine.request import Request
    from engine.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(model=str(resolve_model_path(model)), **engine))
    warm_up(core)
    prompt = core.tokenizer.encode(core.tokenizer.apply_chat_template(PROMPT))
    core.add_request(Request("one", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)))
    steps = []
    while core.has_unfinished():
        start = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - start)
    work = {"multiturn": multiturn.workload(core.tokenizer, turns),
            "multiturn_paused": multiturn.workload(core.tokenizer, turns, seed=PAUSED_SEED, think_s=think_s)}
    if many:
        work["many_chats"] = multiturn.workload(core.tokenizer, seed=MANY_SEED, **many)
    rows = {name: multiturn.summarize(run_engine(core, w, "engine")) for name, w in work.items()}
    return {"decode_step_p50_ms": statistics.median(steps[1:]) * 1e3, **rows, "workload": work,
            "weight_mb": weight_bytes(core.model) / MB, "file_mb": checkpoint_bytes(core.config.model) / MB,
            "kv_pool_mb": core.runner.kv_slots.numel() * core.runner.kv_slots.element_size() / MB,
            "threads": (core.thread_budget.threads, core.thread_budget.threads_batch) if core.thread_budget else None,
            "device": str(core.device), "device_name": _device_name(core.device)}


def _device_name(device) -> str:
    import torch
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def plain_transformers(model_path: str, device: str, work: dict[str, Workload]) -> dict:
    """Plain `transformers` on the same device: its decode step (a forward of each row's newest token over its own
    KV cache) at batch 1 with the one stream's context, and at the many chats' batch with their first turn's
    context; output tok/s counts decode steps alone (no prefill, no queueing), which flatters it."""
    import torch

    from bench.decode import transformers_step_ms

    dev = torch.device(device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    one = transformers_step_ms(model_path, 1, 128, 32, dtype, dev)  # about the one stream's mean context
    row = {"one_stream_itl_p50_ms": one}
    if "many_chats" in work:
        first_turns = [r for r in work["many_chats"].requests if r.after is None]
        context = len(first_turns[0].prompt_token_ids)
        step = transformers_step_ms(model_path, len(first_turns), context, 16, dtype, dev)
        row["many_chats"] = {"batch": len(first_turns), "context": context, "decode_step_ms": step,
                             "itl_p50_s": step / 1e3, "output_tok_s": len(first_turns) / step * 1e3}
    return row


def weight_bytes(model) -> int:
    """The model's weights, each counted once: parameters, the packed tiles that replaced row-major ones and the
    quantized tiles."""
    tensors = {t.data_ptr(): t for t in model.parameters()}
    for m in model.modules():
        if getattr(m, "packed", None) is not None:
            tensors[m.packed.data_ptr()] = m.packed
        for quant in (getattr(m, "quant", None), getattr(m, "quant_tail", None)):
            if quant is not None:
                tensors.update({t.data_ptr(): t for t in (quant.data, quant.scales, quant.mins)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def checkpoint_bytes(model_path: str) -> int:
    """Bytes of the weight files the model was loaded from (a GGUF file, or safetensors shards)."""
    files = [p for pattern in ("*.gguf", "*.safetensors") for p in Path(model_path).glob(pattern)]
    return sum(p.resolve().stat().st_size for p in files)


# ---- through HTTP

class Server:
    """A server subprocess: ours (`python -m gateway serve`) or llama-server; `url` is its /v1 base."""

    def __init__(self, cmd: list[str], ready: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        deadline = time.monotonic() + 600
        for line in self.proc.stdout:  # (llama-server logs to stdout, ours to stderr: both read here)
            if match := re.search(ready, line):
                self.url = match.group(1)
                break
            if time.monotonic() > deadline:
                break
        else:
            raise RuntimeError(f"{cmd[0]} did not start")
        self._reader = threading.Thread(target=self.proc.stdout.read, daemon=True)
        self._reader.start()  # keep reading its log so it never blocks on a full pipe

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)  # it reads to the end of the log, then the pipe can close
        self.proc.stdout.close()


def ours(model_path: str, engine_process: bool, port: int, extra: list[str]) -> Server:
    cmd = [sys.executable, "-m", "gateway", "serve", "--model", model_path, "--port", str(port), "--log-level", "info",
           *extra]
    if not engine_process:
        cmd.append("--no-engine-process")
    return Server(cmd, r"listening on (http://\S+/v1)")


def llama_server(binary: str, gguf: str, port: int, threads: int | None = None) -> Server:
    cmd = [binary, "-m", gguf, "-np", "4", "-c", "8192", "-t", str(threads or os.cpu_count() or 1),
           "--host", "127.0.0.1", "--port", str(port)]
    server = Server(cmd, r"(listening on http://\S+)")
    server.url = f"http://127.0.0.1:{port}/v1"
    return server


async def one_stream(url: str, model: str, tokens: int) -> float:
    """Inter-token gap p50 (ms) of one streamed answer of `tokens` tokens."""
    from bench.http import lean_session, stream_chunks

    body = {"model": model, "messages": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with lean_session() as session:
        for _ in range(2):  # the first warms the server's caches
            times = []
            async for chunk in stream_chunks(session, url, body):
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(times, times[1:])) * 1e3


async def chats(url: str, model: str, work: Workload) -> dict:
    from bench.driver import RunResult
    from bench.http import drive_lean

    timings, duration = await drive_lean(url, model, work, {"ignore_eos": True})
    return multiturn.summarize(RunResult(work.name, "http", timings, duration, 0, 0))


def served_model(url: str) -> str:
    """The model's name as the server lists it (ours: a GGUF file's own name; llama-server takes any)."""
    import urllib.request

    with urllib.request.urlopen(url + "/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def served_threads(url: str) -> tuple[int, int] | None:
    """The engine's thread budget (decode, prefill) as the server's /metrics states it; None where it states none
    (llama-server, a GPU engine)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return None
    found = dict(re.findall(r'^prefixgate_engine_threads\{[^}]*kind="(\w+)"[^}]*\} (\S+)$', text, re.MULTILINE))
    return (int(float(found["decode"])), int(float(found["prefill"]))) if len(found) == 2 else None


def measure(server: Server, model: str, tokens: int, work: dict[str, Workload]) -> dict:
    time.sleep(3)  # idle: start-up work (thread timing, warm-up) done
    threads = served_threads(server.url)  # chosen at its start-up, as in process: the two may differ
    idle = pss_mb(server.proc.pid)
    itl = asyncio.run(one_stream(server.url, model, tokens))
    rows = {name: asyncio.run(chats(server.url, model, w)) for name, w in work.items()}
    after = pss_mb(server.proc.pid)
    return {"one_stream_itl_p50_ms": itl, **rows, "threads": threads, "pss_idle_mb": idle, "pss_after_mb": after,
            "pss_idle_total_mb": sum(idle.values()), "pss_after_total_mb": sum(after.values())}


def idle_pss(model_path: str, port: int, extra: list[str]) -> int:
    """`serve`'s PSS at idle, per process, against the budget (the weight file + the KV pool's configured size +
    500 MB)."""
    from engine.config import EngineConfig

    server = ours(model_path, True, port, extra)
    try:
        time.sleep(3)  # as measure(): start-up work done
        idle = pss_mb(server.proc.pid)
    finally:
        server.stop()
    budget = checkpoint_bytes(model_path) / MB + EngineConfig(model=model_path).kv_cache_memory_mb + 500
    for name, mb in idle.items():
        print(f"{mb:8.0f} MB  {name}")
    total = sum(idle.values())
    print(f"{total:8.0f} MB  in all; budget {budget:.0f} MB: {'met' if total <= budget else 'missed'}")
    return 0 if total <= budget else 1


# ---- report

def targets(result: dict) -> list[tuple[str, str, bool | None]]:
    inproc, serve = result["in_process"], result["serve"]
    peer = result.get("llama.cpp")
    out = []

    def add(name: str, value: float | None, bound: float, figure: str, above: bool = False):
        met = None if value is None else (value >= bound if above else value <= bound)
        out.append((name, figure, met))

    ratio = serve["one_stream_itl_p50_ms"] / inproc["decode_step_p50_ms"]
    add("one stream: ITL p50 <= 1.05x in-process step", ratio, 1.05,
        f"{serve['one_stream_itl_p50_ms']:.1f} / {inproc['decode_step_p50_ms']:.1f} ms = {ratio:.2f}x")
    m_in, m_http = inproc["multiturn_paused"], serve["multiturn_paused"]
    itl = m_http["itl_p50_s"] / m_in["itl_p50_s"]
    add("4 chats (paused): ITL p50 <= 1.1x in process", itl, 1.1,
        f"{m_http['itl_p50_s'] * 1e3:.1f} / {m_in['itl_p50_s'] * 1e3:.1f} ms = {itl:.2f}x")
    ttft = m_http["ttft_p50_s"] / m_in["ttft_p50_s"]
    add("4 chats (paused): TTFT p50 <= 1.2x in process", ttft, 1.2,
        f"{m_http['ttft_p50_s']:.3f} / {m_in['ttft_p50_s']:.3f} s = {ttft:.2f}x")
    if "many_chats" in inproc:
        m_in, m_http = inproc["many_chats"], serve["many_chats"]
        itl = m_http["itl_p50_s"] / m_in["itl_p50_s"]
        add("many chats: ITL p50 <= 1.1x in process", itl, 1.1,
            f"{m_http['itl_p50_s'] * 1e3:.1f} / {m_in['itl_p50_s'] * 1e3:.1f} ms = {itl:.2f}x")
    if inproc.get("device", "cpu") == "cpu":  # on a GPU the weights and the pool live in device memory
        budget = inproc["file_mb"] + inproc["kv_pool_mb"] + 500
        add("PSS at idle <= weight file + KV pool + 500 MB", serve["pss_idle_total_mb"], budget,
            f"{serve['pss_idle_total_mb']:.0f} MB (budget {budget:.0f} MB)")
    if peer:  # issue 42's bar: the same file, served side by side
        r = serve["one_stream_itl_p50_ms"] / peer["one_stream_itl_p50_ms"]
        add("one stream: ITL p50 <= 0.8x llama.cpp", r, 0.8,
            f"{serve['one_stream_itl_p50_ms']:.1f} / {peer['one_stream_itl_p50_ms']:.1f} ms = {r:.2f}x")
        closed = serve["multiturn"]
        tok = closed["output_tok_s"] / peer["multiturn"]["output_tok_s"]
        add("4 chats (closed loop): output tok/s >= 2x llama.cpp", tok, 2.0,
            f"{closed['output_tok_s']:.1f} / {peer['multiturn']['output_tok_s']:.1f} = {tok:.2f}x", above=True)
        paused = serve["multiturn_paused"]["ttft_p50_s"] / peer["multiturn_paused"]["ttft_p50_s"]
        add("4 chats (paused): TTFT p50 <= 0.8x llama.cpp", paused, 0.8,
            f"{serve['multiturn_paused']['ttft_p50_s']:.3f} / {peer['multiturn_paused']['ttft_p50_s']:.3f} s "
            f"= {paused:.2f}x")
    return out


def render(result: dict) -> str:
    lines = [f"{'':28}{'one stream':>12}{'4 chats closed loop':>28}{'4 chats paused':>20}{'PSS':>18}",
             f"{'':28}{'ITL p50':>12}{'ITL p50':>10}{'TTFT p50':>10}{'tok/s':>8}{'ITL p50':>10}{'TTFT p50':>10}"
             f"{'idle':>9}{'after':>9}"]
    for name in ("in_process", "serve", "serve --no-engine-process", "llama.cpp"):
        row = result.get(name)
        if row is None:
            continue
        one = row.get("one_stream_itl_p50_ms", row.get("decode_step_p50_ms"))
        m, p = row["multiturn"], row["multiturn_paused"]
        pss = f"{row['pss_idle_total_mb']:.0f} MB" if "pss_idle_total_mb" in row else "-"
        after = f"{row['pss_after_total_mb']:.0f} MB" if "pss_after_total_mb" in row else "-"
        lines.append(f"{name:28}{one:>9.1f} ms{m['itl_p50_s'] * 1e3:>7.1f} ms{m['ttft_p50_s']:>8.3f} s"
                     f"{m['output_tok_s']:>8.1f}{p['itl_p50_s'] * 1e3:>7.1f} ms{p['ttft_p50_s']:>8.3f} s"
                     f"{pss:>9}{after:>9}")
    for name, row in result.items():
        if isinstance(row, dict) and "pss_idle_mb" in row:
            lines.append(f"  {name} PSS per process at idle: " +
                         ", ".join(f"{k.split()[0]} ({' '.join(k.split()[1:])}) {v:.0f} MB"
                                   for k, v in row["pss_idle_mb"].items()))
    budgets = [f"{name} {row['threads'][0]} / {row['threads'][1]}" for name, row in result.items()
               if isinstance(row, dict) and row.get("threads")]
    if budgets:
        lines.append("  threads (decode / prefill steps): " + ", ".join(budgets))
    if "transformers" in result:
        lines.append(f"{'transformers':28}{result['transformers']['one_stream_itl_p50_ms']:>9.1f} ms"
                     "  (plain transformers' decode step at batch 1, context 128)")
    many = [(name, result[name]["many_chats"]) for name in ("in_process", "serve", "serve --no-engine-process",
                                                              "transformers") if "many_chats" in result.get(name, {})]
    if many:
        lines.append(f"many chats ({result['many_chats_workload']}):")
        lines.append(f"{'':28}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}{'tok/s':>9}")
        for name, row in many:
            if name == "transformers":  # decode steps alone
                lines.append(f"{name:28}{'-':>10}{'-':>10}{row['itl_p50_s'] * 1e3:>7.1f} ms{'-':>10}"
                             f"{row['output_tok_s']:>9.0f}  (decode step at batch {row['batch']}, "
                             f"context {row['context']})")
                continue
            lines.append(f"{name:28}{row['ttft_p50_s']:>8.3f} s{row['ttft_p99_s']:>8.3f} s"
                         f"{row['itl_p50_s'] * 1e3:>7.1f} ms{row['itl_p99_s'] * 1e3:>7.1f} ms{row['output_tok_s']:>9.0f}")
    lines.append("targets:")
    for name, figure, met in result["targets"]:
        lines.append(f"  {'met   ' if met else 'missed' if met is not None else 'n/a   '} {name}: {figure}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("in_process", "serve", "serve --no-engine-process", "llama.cpp") if n in result]
    one = [result[n].get("one_stream_itl_p50_ms", result[n].get("decode_step_p50_ms")) for n in names]
    itl = [result[n]["multiturn_paused"]["itl_p50_s"] * 1e3 for n in names]
    ttft = [result[n]["multiturn_paused"]["ttft_p50_s"] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].bar(names, one, color="#4878a8")
    axes[0].set_title("one stream: inter-token gap p50 (ms)")
    axes[1].bar(names, itl, color="#d08040")
    axes[1].set_title("4 chats (paused): ITL p50 (ms)")
    axes[2].bar(names, ttft, color="#60a060")
    axes[2].set_title("4 chats (paused): TTFT p50 (s)")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=200, help="tokens of the one stream")
    parser.add_argument("--turns", type=int, default=4, help="turns of each of the 4 chats")
    parser.add_argument("--think-s", type=float, default=1.0, help="the chats' pause before each later turn")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--no-thread-mode", action="store_true", help="skip `serve --no-engine-process`")
    parser.add_argument("--serve-args", default="", help="more flags for our servers, e.g. '--threads-batch 1'")
    parser.add_argument("--llama-server", default=None, help="llama-server binary (../shared/peers/)")
    parser.add_argument("--llama-gguf", default=None,
                        help="the same weights for llama-server (the default model: its own Q4_1 file)")
    parser.add_argument("--llama-threads", type=int, default=None,
                        help="llama-server's -t (default: every core; on a loaded machine our engines may time 1 "
                             "thread faster at start-up, which this lets llama.cpp match)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="the engine's device, in process and served")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="the engine's batch, in process and served")
    parser.add_argument("--quantized-activations", default="float32", choices=("float32", "int8"),
                        help="quantized weights on CPU, in process and served: int8 runs their matmuls on integer "
                             "dot products (llama.cpp's way; answers change by the activations' rounding)")
    parser.add_argument("--many-chats", type=int, default=0,
                        help="also this many concurrent chats on one shared system prompt, closed loop (0: none)")
    parser.add_argument("--many-prefix-tokens", type=int, default=2000, help="the many chats' system prompt")
    parser.add_argument("--many-turns", type=int, default=2, help="turns of each of the many chats")
    parser.add_argument("--transformers", action="store_true",
                        help="also plain transformers' decode step on the same device, for the one stream and the "
                             "many chats' batch")
    parser.add_argument("--idle-pss-only", action="store_true",
                        help="only start `serve`, and print its processes' PSS at idle against the memory budget")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    from engine.model.loader import resolve_model_path
    model_path = str(resolve_model_path(args.model))
    if args.idle_pss_only:
        return idle_pss(model_path, args.port, [f"--device={args.device}", *args.serve_args.split()])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    print("in process ...", flush=True)
    engine = {"device": args.device}
    if args.max_num_seqs:
        engine["max_num_seqs"] = args.max_num_seqs
    if args.quantized_activations != "float32":
        engine["quantized_activations"] = args.quantized_activations
    many = {"chats": args.many_chats, "prefix_tokens": args.many_prefix_tokens,
            "turns": args.many_turns} if args.many_chats else {}
    inproc = in_process(args.model, args.tokens, args.turns, args.think_s, engine, many)
    work = inproc.pop("workload")
    result: dict = {"in_process": inproc, "engine": engine}
    if many:
        result["many_chats_workload"] = work["many_chats"].description
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()] + args.serve_args.split()
    runs = [("serve", lambda: ours(model_path, True, args.port, extra))]
    if not args.no_thread_mode:
        runs.append(("serve --no-engine-process", lambda: ours(model_path, False, args.port, extra)))
    if args.llama_server and args.llama_gguf:
        runs.append(("llama.cpp", lambda: llama_server(args.llama_server, args.llama_gguf, args.port,
                                                             args.llama_threads)))
    for name, start in runs:  # one server at a time: they take turns on the cores
        print(f"{name} ...", flush=True)
        server = start()
        try:
            result[name] = measure(server, served_model(server.url), args.tokens, work)
        finally:
            server.stop()
    if args.transformers:
        print("transformers ...", flush=True)
        result["transformers"] = plain_transformers(model_path, args.device, work)
    result["targets"] = targets(result)
    print(render(result))
    (out / "serving.json").write_text(json.dumps(result, indent=2, default=str))
    print("plot:", plot(result, out / "serving.png"))
    return 0 if all(met is not False for _, _, met in result["targets"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
