"""bench serving's report (which run each target reads, and the table) and its lean HTTP client."""
import asyncio
import os
import subprocess
import sys

import pytest

from bench import multiturn, serving
from bench.http import drive_lean
from engine.tokenizer import load_tokenizer
from tests.support.gateway_helpers import LiveServer, tiny_settings

BLOCK = 16


def _chats(itl_ms: float, ttft_s: float, tok_s: float) -> dict:
    return {"itl_p50_s": itl_ms / 1e3, "ttft_p50_s": ttft_s, "output_tok_s": tok_s}


def _result() -> dict:
    server = {"pss_idle_mb": {"1 -m gateway serve": 70.0}, "pss_after_mb": {}, "pss_idle_total_mb": 2000.0,
              "pss_after_total_mb": 2010.0}
    return {
        "in_process": {"decode_step_p50_ms": 20.0, "weight_mb": 115.0, "file_mb": 96.6, "kv_pool_mb": 1000.0,
                       "multiturn": _chats(30.0, 0.5, 56.0), "multiturn_paused": _chats(30.0, 1.0, 40.0)},
        # closed loop through HTTP: TTFT twice in process (arrival phase); paused: within the targets
        "serve": {"one_stream_itl_p50_ms": 20.5, "multiturn": _chats(32.0, 1.0, 57.0),
                  "multiturn_paused": _chats(32.0, 1.1, 41.0), **server},
        "llama.cpp": {"one_stream_itl_p50_ms": 26.0, "multiturn": _chats(80.0, 3.0, 21.0),
                      "multiturn_paused": _chats(82.0, 3.3, 18.0), **server},
    }


def test_targets_read_the_paused_chats_against_in_process_and_the_closed_loop_against_llama_cpp():
    targets = {name: (figure, met) for name, figure, met in serving.targets(_result())}
    assert targets["4 chats (paused): TTFT p50 <= 1.2x in process"] == ("1.100 / 1.000 s = 1.10x", True)
    assert targets["4 chats (paused): ITL p50 <= 1.1x in process"] == ("32.0 / 30.0 ms = 1.07x", True)
    assert targets["4 chats (closed loop): output tok/s >= 2x llama.cpp"] == ("57.0 / 21.0 = 2.71x", True)
    assert targets["4 chats (paused): TTFT p50 <= 0.8x llama.cpp"] == ("1.100 / 3.300 s = 0.33x", True)
    assert targets["one stream: ITL p50 <= 1.05x in-process step"] == ("20.5 / 20.0 ms = 1.02x", True)
    # the budget is the weight file's bytes, not the tiles the engine packed from it
    assert targets["PSS at idle <= weight file + KV pool + 500 MB"] == ("2000 MB (budget 1597 MB)", False)
    assert targets["one stream: ITL p50 <= 0.8x llama.cpp"] == ("20.5 / 26.0 ms = 0.79x", True)


def test_render_shows_both_chat_runs_every_target_and_each_engine_s_threads():
    result = _result()
    result["in_process"]["threads"], result["serve"]["threads"] = [2, 2], [1, 2]  # (JSON keeps lists)
    result["targets"] = serving.targets(result)
    text = serving.render(result)
    assert "  threads (decode / prefill steps): in_process 2 / 2, serve 1 / 2" in text.splitlines()
    serve_row = next(line for line in text.splitlines() if line.startswith("serve "))
    assert "1.000 s" in serve_row and "1.100 s" in serve_row  # closed-loop and paused TTFT
    assert text.count("met    ") == len(result["targets"]) - 1 == 6
    assert "missed PSS at idle" in text


def test_on_a_gpu_the_many_chats_are_held_to_in_process_and_memory_is_not_judged():
    result = _result()
    del result["llama.cpp"]
    result["in_process"]["device"] = "cuda:0"
    many = {"ttft_p50_s": 0.2, "ttft_p99_s": 0.9, "itl_p99_s": 0.5, "output_tok_s": 2100.0}
    result["in_process"]["many_chats"] = {**many, "itl_p50_s": 0.0065}
    result["serve"]["many_chats"] = {**many, "itl_p50_s": 0.0054}
    result["many_chats_workload"] = "64 concurrent chats"
    result["transformers"] = {"one_stream_itl_p50_ms": 91.0,
                              "many_chats": {"batch": 64, "context": 2140, "itl_p50_s": 0.075, "output_tok_s": 853.3}}
    result["targets"] = serving.targets(result)
    targets = {name: (figure, met) for name, figure, met in result["targets"]}
    assert targets["many chats: ITL p50 <= 1.1x in process"] == ("5.4 / 6.5 ms = 0.83x", True)
    assert not any(name.startswith("PSS") for name in targets)
    text = serving.render(result)
    assert "many chats (64 concurrent chats):" in text
    assert "transformers" + " " * 21 + "91.0 ms  (plain transformers" in text
    assert "853  (decode step at batch 64, context 2140)" in text


def test_many_chats_share_one_system_prompt_of_the_asked_length(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir, set())
    work = multiturn.workload(tokenizer, turns=2, chats=6, prefix_tokens=300)
    assert work.name == "multiturn6" and len(work.requests) == 12
    systems = {r.messages[0]["content"] for r in work.requests}
    assert len(systems) == 1
    assert abs(len(tokenizer.encode(systems.pop())) - 300) <= 30


def test_paused_chats_wait_before_every_later_turn(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir, set())
    work = multiturn.workload(tokenizer, turns=3, think_s=0.75)
    assert [r.think_s for r in work.requests if r.after is None] == [0.0] * multiturn.CHATS
    assert {r.think_s for r in work.requests if r.after is not None} == {0.75}
    closed = multiturn.workload(tokenizer, turns=3)
    assert {r.think_s for r in closed.requests} == {0.0}


def test_the_lean_client_reads_timings_and_usage_from_a_real_server(tiny_llama_dir):
    """bench serving's aiohttp client against the gateway on a real port (tiny model, the engine in process:
    the client sees HTTP alone): every turn streams its tokens, later turns report the earlier turns' prompt as
    cached, one stream yields a gap, and /metrics gives the engine's thread budget."""
    tokenizer = load_tokenizer(tiny_llama_dir, set())
    work = multiturn.workload(tokenizer, turns=2)
    for r in work.requests:
        r.max_tokens = 4
    settings = tiny_settings(tiny_llama_dir, engine={"num_kv_blocks": None, "kv_cache_memory_mb": 64,
                                                     "block_size": BLOCK, "threads": 1, "threads_batch": 2})
    with LiveServer(settings) as server:
        base_url, model = server.url + "/v1", server.state.model_name
        timings, duration = asyncio.run(drive_lean(base_url, model, work, {"ignore_eos": True}))
        gap_ms = asyncio.run(serving.one_stream(base_url, model, 5))
        threads = serving.served_threads(base_url)
    by_id = {t.request_id: t for t in timings}
    assert len(by_id) == len(work.requests) and duration > 0
    for r in work.requests:
        t = by_id[r.request_id]
        assert t.num_output_tokens == 4 and t.num_prompt_tokens == len(r.prompt_token_ids) and not t.error
        assert 0 < t.ttft <= t.e2e
        if r.after is not None:  # the full blocks this turn shares with the previous turn's prompt are hits
            previous = next(p for p in work.requests if p.request_id == r.after).prompt_token_ids
            shared = next((i for i, (a, b) in enumerate(zip(previous, r.prompt_token_ids)) if a != b), len(previous))
            assert t.num_cached_tokens == shared // BLOCK * BLOCK
    assert gap_ms > 0
    assert threads == (1, 2)


def test_checkpoint_bytes_counts_the_gguf_file_behind_its_link_and_safetensors_shards(tmp_path):
    (tmp_path / "real.gguf").write_bytes(b"g" * 300)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.gguf").symlink_to(tmp_path / "real.gguf")
    (model / "config.json").write_text("{}")
    assert serving.checkpoint_bytes(str(model)) == 300
    (model / "model-00001.safetensors").write_bytes(b"s" * 50)
    assert serving.checkpoint_bytes(str(model)) == 350


@pytest.mark.server
def test_idle_pss_only_prints_each_process_against_the_budget(tiny_llama_dir, capsys):
    assert serving.idle_pss(str(tiny_llama_dir), 0, ["--device=cpu", "--responses-db", ":memory:"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("-m gateway serve" in line for line in lines) and any("engine.engine_process" in line for line in lines)
    assert lines[-1].endswith(": met") and "in all; budget" in lines[-1]


def test_a_bench_process_spins_its_openmp_threads_as_the_engine_process_does():
    """Benchmarks import torch at their top; the engine's spin default must be in the environment before, or the
    in-process engine's OpenMP pool spins as libgomp's default while `serve`'s engine process spins briefly."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", "import sys, os, bench; "
                          "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["10000", "False"]


def test_pss_counts_pages_shared_with_another_process_whole(tmp_path):
    """The kernel's PSS halves a page this process maps too (the bench maps torch and numba, as `serve` does):
    pss_mb counts the server's own pages whole, as they would be without the bench beside it."""
    import mmap

    import psutil

    from bench.serving import MB, pss_mb

    data = tmp_path / "shared.bin"
    data.write_bytes(b"\1" * (32 * MB))
    code = ("import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); "
            "sum(m[i] for i in range(0, len(m), 4096)); print('mapped', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code, str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "mapped"
        with open(data, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mine:
            sum(mine[i] for i in range(0, len(mine), 4096))  # the same pages, now shared by two processes
            kernel = psutil.Process(child.pid).memory_full_info().pss / MB
            (alone,) = pss_mb(child.pid).values()
        assert alone - kernel > 12  # the file's 32 MB: half of it went to this process in the kernel's count
    finally:
        child.stdin.close()
        child.wait(10)
        child.stdout.close()
