"""The decode roofline and multi-turn benchmarks run end to end on a tiny model (behaviour, not times)."""
from __future__ import annotations

import pytest

from bench import decode, multiturn, report
from bench.driver import run_engine
from engine.core import EngineCore
from engine.config import EngineConfig
from engine.runner import ModelRunner


def test_decode_rows_carry_the_roofline(tiny_llama_dir):
    result = decode.run(str(tiny_llama_dir), batches=(1, 2), context=40, steps=4, log=lambda _: None,
                        num_kv_blocks=64)
    rows = result["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["bandwidth_gb_s"] > 0 and r["roofline_ms"] > 0 and r["weight_mb"] > 0 for r in rows)
    assert rows[1]["kv_mb"] == 2 * rows[0]["kv_mb"]
    assert result["batch8_over_batch1"] is None  # no batch 8 asked for
    targets = {t["target"] for t in report.decode_targets({"decode": result})}
    assert targets == {"decode batch 1 vs roofline"}


def test_decode_with_a_shared_prefix_decodes_by_cascade_and_counts_the_prefix_once(tiny_llama_dir, monkeypatch):
    """The batch's prompts share their first 32 tokens (8 blocks): the decode steps attend them as one cascade
    group, and the roofline counts their K/V once."""
    groups = []
    shared_prefixes = ModelRunner._shared_prefixes

    def spy(self, seqs):
        found = shared_prefixes(self, seqs)
        groups.append([(len(g.rows), len(g.slots)) for g in found[0]])
        return found

    monkeypatch.setattr(ModelRunner, "_shared_prefixes", spy)
    result = decode.run(str(tiny_llama_dir), batches=(2,), context=40, steps=4, log=lambda _: None,
                        num_kv_blocks=64, shared_prefix=32, block_size=4)
    assert [(2, 32)] in groups
    row = result["rows"][0]
    distinct = decode.run(str(tiny_llama_dir), batches=(2,), context=40, steps=4, log=lambda _: None,
                          num_kv_blocks=64, block_size=4)["rows"][0]
    # the shared 32 tokens once, then each row's own 8 and half of the 4 decoded ones
    assert row["shared_prefix"] == 32 and row["kv_mb"] == pytest.approx(distinct["kv_mb"] * (32 + 2 * 10) / (2 * 42))


def test_multiturn_workload_shares_the_prefix_and_counts_mixed_steps(tiny_llama_dir):
    core = EngineCore(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=512, max_num_batched_tokens=64))
    work = multiturn.workload(core.tokenizer, turns=2)
    assert len(work.requests) == 2 * multiturn.CHATS
    steps = multiturn.StepLog(core)
    row = multiturn.summarize(run_engine(core, work, "engine"))
    assert row["errors"] == 0 and row["output_tokens"] == len(work.requests) * multiturn.OUTPUT_TOKENS
    assert row["cached_tokens"] > 0  # every chat after the first hits the shared system prompt
    breakdown = steps.breakdown()
    assert breakdown["decode_steps"] > 0 and 0 <= breakdown["with_prefill"] <= breakdown["decode_steps"]


def test_batch8_targets_name_the_roofline_ratio_for_distinct_and_shared_prompts():
    def run(shared, kv_mb_8, step_8):
        rows = [{"batch": b, "context": 1000, "shared_prefix": shared, "weight_mb": 500.0, "kv_mb": kv,
                 "step_ms": step, "roofline_ms": 10.0, "bandwidth_gb_s": 50.0, "roofline_ratio": 0.8}
                for b, kv, step in ((1, 50.0, 14.0), (8, kv_mb_8, step_8))]
        return {"rows": rows, "batch8_over_batch1": step_8 / 14.0}

    targets = {t["target"]: t for t in report.decode_targets({"decode": run(0, 400.0, 28.0),
                                                              "decode_shared": run(960, 80.0, 19.6)})}
    distinct = targets["decode batch 8 vs batch 1 step"]
    assert distinct["status"] == "missed" and "2.00x (at the roofline: 1.64x)" in distinct["figure"]
    shared = targets["decode batch 8 vs batch 1 step, shared prefix"]
    assert shared["status"] == "met" and "1.40x (at the roofline: 1.05x, 960 of 1000 tokens shared)" in shared["figure"]
    # where batch 8's steps were also timed in turns with batch 1's, that ratio decides
    in_turns = run(960, 80.0, 19.6) | {"batch8_in_turns": {"ratio": 1.6, "batch_ms": 17.6, "batch1_ms": 11.0}}
    shared = report.decode_targets({"decode": run(0, 400.0, 28.0), "decode_shared": in_turns})[-1]
    assert shared["status"] == "missed" and shared["figure"].startswith("in turns 17.6 vs 11.0 ms = 1.60x; apart 19.6")


def test_batch8_steps_are_timed_in_turns_with_a_batch1_engine_over_the_same_weights(tiny_llama_dir, monkeypatch):
    engines = []
    init = EngineCore.__init__

    def spy(self, config, model=None):
        init(self, config, model)
        engines.append(self)

    monkeypatch.setattr(EngineCore, "__init__", spy)
    result = decode.run(str(tiny_llama_dir), batches=(1, 8), context=40, steps=3, log=lambda _: None,
                        num_kv_blocks=64, block_size=4)
    turns = result["batch8_in_turns"]
    assert turns["pairs"] == 3 and turns["ratio"] > 0 and turns["batch_ms"] > 0 and turns["batch1_ms"] > 0
    main, partner = engines
    assert partner.model is main.model and partner.runner.kv_slots is not main.runner.kv_slots
    assert not main.requests and not partner.requests  # every decode aborted: no KV blocks left held
    assert partner.kv.pool.num_free_blocks == len(partner.kv.pool.blocks)


@pytest.mark.parametrize("name,says", [("q5_k", "not a format the engine runs"), ("q9_9", "not a ggml format")])
def test_matmul_bench_refuses_a_format_it_cannot_make_before_it_starts(name, says, capsys):
    from bench import matmul
    with pytest.raises(SystemExit) as refused:
        matmul.main(["--quantized", f"q8_0,{name}", "--rows", "1", "--repeats", "1"])
    assert refused.value.code == 2 and says in capsys.readouterr().err


def test_matmul_bench_times_every_kernel_over_the_models_step_shapes(tiny_llama_dir):
    from bench import matmul
    from engine.model.model_config import load_config
    config = load_config(tiny_llama_dir)
    result = matmul.run(str(tiny_llama_dir), rows=(1, 9), repeats=1, log=lambda _: None)
    assert [r["rows"] for r in result["rows"]] == [1, 9]
    assert all(r["matmuls"] == 4 * config.num_hidden_layers + 1 for r in result["rows"])
    assert {"packed (engine)", "F.linear"} <= set(result["rows"][0]["ms"]) and all(
        ms > 0 for r in result["rows"] for ms in r["ms"].values())


def test_matmul_bench_packs_the_quantized_kernels_scales_as_the_loader_does(tiny_llama_dir):
    """Q4_1's scales and mins are fp16 values: both kernels read them as fp16, so both read the same bytes."""
    from bench import matmul
    from engine.model import quant_dot_cpu
    if not quant_dot_cpu.X86:
        pytest.skip("integer dot products are x86 code")
    result = matmul.run(str(tiny_llama_dir), rows=(1,), repeats=1, log=lambda _: None, quantized=("q4_1",))
    bytes_mb = result["rows"][0]["bytes_mb"]
    assert bytes_mb["q4_1 int8 (engine)"] == bytes_mb["q4_1 float (engine)"] < bytes_mb["packed (engine)"] / 4


def test_matmul_bench_times_the_float_kernel_beside_the_dequantized_gemm_of_larger_steps(tiny_llama_dir):
    """Each quantized format's float kernel has the path of steps past quant_matmul_cpu.KERNEL_ROWS beside it, over
    the same tiles: where one overtakes the other."""
    from bench import matmul
    result = matmul.run(str(tiny_llama_dir), rows=(1, 40), repeats=1, log=lambda _: None, quantized=("q8_0", "q4_1"))
    for row in result["rows"]:
        for name in ("q8_0 float", "q4_1 float"):
            assert row["ms"][f"{name} dequantized + GEMM"] > 0
            assert row["bytes_mb"][f"{name} dequantized + GEMM"] == row["bytes_mb"][f"{name} (engine)"]
        assert not any(name.endswith("int8 dequantized + GEMM") for name in row["ms"])


def test_matmul_bench_times_the_k_quants_on_random_blocks_with_their_super_block_records(k_quant_llama_dir):
    """The gguf library cannot quantize to Q4_K or Q6_K: the bench decodes random blocks of them as a file's and
    packs them as the loader does (super-block records), 4.625 and 6.5625 bits a weight."""
    from bench import matmul
    from engine.model.model_config import load_config
    result = matmul.run(str(k_quant_llama_dir), rows=(1, 3), repeats=1, log=lambda _: None, quantized=("q4_k", "q6_k"))
    row = result["rows"][0]
    weights = sum(n * k for n, k in matmul.step_shapes(load_config(k_quant_llama_dir)))
    assert row["bytes_mb"]["q4_k float (engine)"] * 1e6 * 8 / weights == pytest.approx(4.625, abs=0.01)
    assert row["bytes_mb"]["q6_k float (engine)"] * 1e6 * 8 / weights == pytest.approx(6.5625, abs=0.01)
    assert all(ms > 0 for r in result["rows"] for ms in r["ms"].values())


def test_attention_bench_runs_the_kernel_over_every_layer_and_counts_a_shared_prefix_once(tiny_llama_dir):
    from bench import attention
    from engine.model.model_config import load_config
    runs = {shared: attention.run(str(tiny_llama_dir), batch=3, context=40, shared_prefix=shared, repeats=2,
                                  log=lambda _: None) for shared in (0, 24)}
    assert all(r["ms"] > 0 and r["layers"] == load_config(tiny_llama_dir).num_hidden_layers for r in runs.values())
    assert runs[24]["kv_mb"] == pytest.approx(runs[0]["kv_mb"] * (24 + 3 * 16) / (3 * 40))
    assert attention.run(str(tiny_llama_dir), batch=2, context=100, in_cache=True, repeats=1,
                         log=lambda _: None)["in_cache"]
    between = attention.run(str(tiny_llama_dir), batch=3, context=40, shared_prefix=24, repeats=1,
                            between_matmuls=True, log=lambda _: None)
    assert between["between_matmuls"] and between["ms"] > 0 and between["kv_mb"] == runs[24]["kv_mb"]


def test_step_profile_lists_a_steps_ops(tiny_llama_dir):
    from bench import step_profile
    result = step_profile.run(str(tiny_llama_dir), batch=2, context=40, steps=2)
    assert result["device"] == "cpu" and result["batch"] == 2
    assert result["rows"] and all(r["us_per_step"] >= 0 and r["per_step"] > 0 for r in result["rows"])
    assert result["total_us_per_step"] == pytest.approx(sum(r["us_per_step"] for r in result["rows"]))


def test_step_profile_of_prefill_steps_times_one_whole_prompt_each(tiny_llama_dir):
    from bench import step_profile
    result = step_profile.run_prefill(str(tiny_llama_dir), tokens=64, steps=2, cpu_kernels="eager")
    assert result["tokens"] == 64 and result["prefill_kernel"] is False  # CPU: the gather path
    names = {r["name"] for r in result["rows"]}
    assert "aten::mm" in names or "aten::addmm" in names or "aten::linear" in names
    assert result["step_wall_us"] > 0 and result["kernels_per_step"] is None


def test_decode_rows_have_no_graph_replay_on_cpu(tiny_llama_dir):
    row = decode.run(str(tiny_llama_dir), batches=(1,), context=40, steps=2, log=lambda _: None,
                     num_kv_blocks=64)["rows"][0]
    assert row["device"] == "cpu" and row["graph_replay_ms"] is None


def test_random_like_keeps_the_tokenizer_and_takes_the_new_shapes(tiny_llama_dir, tmp_path):
    from transformers import AutoConfig

    from bench.tiny_models import build_random_like
    out = build_random_like(tmp_path / "wide", tiny_llama_dir, hidden_size=96, num_hidden_layers=3)
    config = AutoConfig.from_pretrained(out)
    assert (config.hidden_size, config.num_hidden_layers) == (96, 3)
    assert (out / "tokenizer.json").read_bytes() == (tiny_llama_dir / "tokenizer.json").read_bytes()
    assert EngineCore(EngineConfig(model=str(out), num_kv_blocks=16)).model.config.hidden_size == 96


def test_random_like_another_family_keeps_the_settings_and_tokenizer(tiny_llama_dir, tmp_path):
    """Qwen2.5's shapes for issue 42's larger models: a qwen2 model (q/k/v biases) of the source's settings."""
    from transformers import AutoConfig

    from bench.tiny_models import build_random_like
    out = build_random_like(tmp_path / "qwen", tiny_llama_dir, model_type="qwen2", num_key_value_heads=1)
    config = AutoConfig.from_pretrained(out)
    source = AutoConfig.from_pretrained(tiny_llama_dir)
    assert config.model_type == "qwen2" and config.architectures == ["Qwen2ForCausalLM"]
    assert (config.hidden_size, config.vocab_size, config.num_key_value_heads) == \
        (source.hidden_size, source.vocab_size, 1)
    assert (out / "tokenizer.json").read_bytes() == (tiny_llama_dir / "tokenizer.json").read_bytes()
    model = EngineCore(EngineConfig(model=str(out), num_kv_blocks=16)).model
    assert model.config.model_type == "qwen2"
    assert any(name.endswith("qkv_proj.bias") for name, _ in model.named_parameters())


def test_random_like_a_gguf_model_directory_leaves_its_weights_behind(tiny_llama_dir, tmp_path):
    import shutil

    from bench.tiny_models import build_random_like
    from engine.model.gguf_index import INDEX_NAME
    source = shutil.copytree(tiny_llama_dir, tmp_path / "from-gguf")
    (source / "model.gguf").write_bytes(b"GGUF")  # a GGUF model directory's link to its file, and its index
    (source / INDEX_NAME).write_text("{}")
    out = build_random_like(tmp_path / "wide", source, hidden_size=96)
    assert not (out / "model.gguf").exists() and not (out / INDEX_NAME).exists()
    assert EngineCore(EngineConfig(model=str(out), num_kv_blocks=16)).model.config.hidden_size == 96


def test_saved_decode_runs_plot_together(tiny_llama_dir, tmp_path):
    runs = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, batches in zip(runs, [(1, 2), (1,)]):
        assert decode.main(["--model", str(tiny_llama_dir), "--batches", ",".join(map(str, batches)), "--context", "40",
                            "--steps", "2", "--json", str(path)]) == 0
    plot = tmp_path / "runs.png"
    assert decode.main(["--replot", *map(str, runs), "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_bandwidth_probe_reads_on_every_core_whatever_the_thread_budget_set():
    """The engine's thread budget sets torch's thread count to its decode threads; a probe taken after a one-thread
    step read one core's rate (half the machine's here), and the ratio doubled. It reads on every core, and leaves
    the budget's count as it found it."""
    import os

    import torch

    from bench.decode import bandwidth_gb_s

    seen = []
    probe = torch.ones(1 << 20)
    real_sum = torch.Tensor.sum
    budget = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.Tensor.sum = lambda self, *a, **k: (seen.append(torch.get_num_threads()), real_sum(self, *a, **k))[1]
        bandwidth_gb_s(probe, repeats=2)
        assert seen == [len(os.sched_getaffinity(0))] * 2 and torch.get_num_threads() == 1
    finally:
        torch.Tensor.sum = real_sum
        torch.set_num_threads(budget)
