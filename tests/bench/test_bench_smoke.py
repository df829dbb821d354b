"""The benchmark machinery on a tiny model and tiny workloads: behaviour, not times."""
from __future__ import annotations

import json

import pytest
import torch

from bench import report
from bench.__main__ import parse_args
from bench.driver import make_core, run_engine
from bench.oracle import oracle_prefill_tokens
from bench.suite import ALL_WORKLOADS, plan_for
from bench.workloads import BenchRequest, Scale, Workload

pytestmark = pytest.mark.slow  # whole benchmark runs, at tiny sizes

TINY = Scale(chatbot_users=3, multiturn_convs=1, multiturn_turns=(3, 3), rag_docs=2, rag_requests=3,
             nosharing_requests=3, bursty_hot=3, bursty_bursts=1, lpm_prefixes=2, lpm_per_prefix=2, lpm_unique=1,
             mixed_clients=8, max_tokens=2, time_scale=0.0)

# block size 4; by hand: p1 computes all 9; p2 hits [1-4][5-8] and computes 2; p3 hits [1-4], computes 5;
# p4 is all known blocks but a hit stops at len - 1 tokens, so it recomputes its last block (4);
# p5's [1-4] follows another parent, so nothing hits (8)
HAND_PROMPTS = [list(range(1, 10)), list(range(1, 9)) + [10, 11], [1, 2, 3, 4, 20, 21, 22, 23, 24],
                list(range(1, 9)), [9, 9, 9, 9, 1, 2, 3, 4]]
HAND_ORACLE = 9 + 2 + 5 + 4 + 8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny matmuls: with 2 threads on 2 shared cores the OpenMP hand-offs cost more than the math
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_oracle_counts_each_distinct_block_once():
    assert oracle_prefill_tokens(HAND_PROMPTS, block_size=4) == HAND_ORACLE
    assert oracle_prefill_tokens([[1, 2, 3]] * 3, block_size=4) == 9  # no full block: every token computed


def test_engine_one_at_a_time_computes_exactly_the_oracle(tiny_llama_dir):
    requests = [BenchRequest(f"hand-{i}", p, 0.0, 1, after=f"hand-{i - 1}" if i else None)
                for i, p in enumerate(HAND_PROMPTS)]
    workload = Workload("hand", "", requests)
    core = make_core(str(tiny_llama_dir), workload, {"num_kv_blocks": 64, "block_size": 4})
    result = run_engine(core, workload, "cache-on")
    assert result.oracle == HAND_ORACLE
    assert result.prefill_computed == HAND_ORACLE
    assert [t.num_cached_tokens for t in sorted(result.timings, key=lambda t: t.request_id)] == [0, 8, 4, 4, 0]


@pytest.fixture(scope="module")
def results(tiny_llama_dir, tmp_path_factory):
    from bench.__main__ import run
    out = tmp_path_factory.mktemp("bench")
    args = parse_args(["--model", str(tiny_llama_dir), "--out", str(out), "--quick", "--no-http", "--no-decode"])
    # the tiny model's blocks are tiny: without a cap the default 1 GiB would be ~260K blocks
    suite_opts = {"engine_overrides": {"num_kv_blocks": 512}, "scale": TINY, "log": False}
    return run(args, **suite_opts), out


def test_every_workload_and_variant_has_a_row(results):
    data, out = results
    saved = json.loads((out / "results.json").read_text())
    plan = plan_for(quick=True)
    expected = {(w, v) for w in ALL_WORKLOADS for v in plan.variants[w]}
    # transformers on a subset: it and our engine both run the same requests, as workload "name@N"
    got = {(r["workload"].split("@")[0], r["variant"]) for r in saved["rows"]}
    assert expected <= got
    for row in (r for r in saved["rows"] if r["variant"].startswith("hf-")):
        ours = report.find(saved["rows"], row["workload"], "cache-on")
        assert ours and ours["prompt_tokens"] == row["prompt_tokens"] and ours["requests"] == row["requests"]
    assert all(r["status"] == "ok" for r in saved["rows"]), [r for r in saved["rows"] if r["status"] != "ok"]
    assert all(r["errors"] == 0 and r["requests"] > 0 for r in saved["rows"])
    assert {t["target"] for t in saved["targets"]} >= {"chatbot prefill vs oracle", "chatbot TTFT p50 cache on vs off"}
    assert {h["algo"] for h in saved["extra"]["hash_lookup"]} == {"sha256", "xxhash"}
    assert [row["waiting"] for row in saved["extra"]["lpm_step"]] == [256, 1024]


def test_the_cache_never_computes_more_than_no_cache(results):
    rows = results[0]["rows"]
    for workload in ALL_WORKLOADS:
        on, off = report.find(rows, workload, "cache-on"), report.find(rows, workload, "cache-off")
        if on and off:
            assert on["prefill_computed"] <= off["prefill_computed"], workload
            assert off["hit_rate"] == 0.0
            assert on["prefill_computed"] >= on["oracle"] or workload == "bursty"
    chatbot = report.find(rows, "chatbot", "cache-on")
    assert chatbot["prefill_computed"] < report.find(rows, "chatbot", "cache-off")["prefill_computed"]


def test_plots_and_table_are_written(results):
    data, out = results
    names = {p.split("/")[-1] for p in data["plots"]}
    assert names == {"ttft_p50.png", "prefill_vs_oracle.png", "fcfs_vs_lpm.png"}
    for name in names:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = report.render(data)
    for workload in ALL_WORKLOADS:
        assert workload in text


def test_workloads_are_seeded_and_share_what_they_claim(tiny_llama_dir):
    from bench import workloads
    from engine.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(tiny_llama_dir, set())
    first = workloads.build("chatbot", tokenizer, TINY)
    again = workloads.build("chatbot", tokenizer, TINY)
    assert [r.prompt_token_ids for r in first.requests] == [r.prompt_token_ids for r in again.requests]
    prompts = [r.prompt_token_ids for r in first.requests]
    shared = min(len(p) for p in prompts) - 40
    assert shared > 900 and all(p[:shared] == prompts[0][:shared] for p in prompts)  # the ~1K system prompt
    turns = workloads.build("multiturn", tokenizer, TINY).requests
    for prev, turn in zip(turns, turns[1:]):
        assert turn.after == prev.request_id
        # each turn resends the previous prompt (up to its generation prompt) plus an answer and a question
        assert turn.prompt_token_ids[:len(prev.prompt_token_ids) - 4] == prev.prompt_token_ids[:-4]


def test_the_transformers_subset_keeps_every_kind_in_proportion():
    from collections import Counter

    from bench.workloads import subset
    kinds = [("chat", 12), ("rag", 4), ("unique", 16)]
    requests = [BenchRequest(f"{k}-{i}", [1], 0.0, 1) for k, count in kinds for i in range(count)]
    picked = subset(Workload("mixed", "", requests), 16).requests
    assert Counter(r.request_id.split("-")[0] for r in picked) == {"chat": 6, "rag": 2, "unique": 8}
    assert Counter(r.request_id.split("-")[0] for r in subset(Workload("m", "", requests), 3).requests) == {
        "chat": 1, "rag": 1, "unique": 1}


def test_chatbot_ttft_reports_every_request_of_the_workload(tiny_llama_dir):
    from bench import chatbot_ttft

    result = chatbot_ttft.run(str(tiny_llama_dir), TINY)
    assert len(result["ttfts_s"]) == TINY.chatbot_users
    assert result["ttfts_s"] == sorted(result["ttfts_s"]) and result["ttft_max_s"] == result["ttfts_s"][-1]


def test_multiturn_responses_api_sends_constant_bytes_and_hits_like_chat(tiny_llama_dir):
    from bench.multiturn import run_apis
    out = run_apis(str(tiny_llama_dir), turns=3, log=lambda *_: None)
    chat, responses = out["apis"]["chat"], out["apis"]["responses"]
    assert chat["errors"] == responses["errors"] == 0
    assert responses["prompt_tokens"] == chat["prompt_tokens"]  # the server rebuilt the same conversations
    assert responses["cached_tokens"] == chat["cached_tokens"] > 0
    grows, flat = chat["request_bytes_by_turn"], responses["request_bytes_by_turn"]
    assert grows[0] < grows[1] < grows[2]
    assert flat[1] < flat[0] / 2 and abs(flat[2] - flat[1]) < 0.1 * flat[1]  # only the new message
