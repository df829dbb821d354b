"""One request can never hurt another: whatever breaks while the engine works on one request (its sampling,
its blocks, its text, its stop checks) finishes that request with an error and nothing else; what breaks
for a whole step fails that step's requests; the pool always gets every block back."""
from __future__ import annotations

import math
import random

import pytest
import torch

from bench.engine_faults import assert_blocks_released
from engine import LLM, EngineConfig, SamplingParams
from engine.core import EngineCore
from engine.request import Request

GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture
def core(tiny_llama_dir) -> EngineCore:
    return LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=16).core


def prompts(n: int, length: int = 40) -> list[list[int]]:
    rng = random.Random(n * 1000 + length)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def run(core: EngineCore, requests: list[Request], added=lambda: None) -> dict[str, list]:
    """Adds the requests (then calls `added`), steps until all are done; each request's outputs in order."""
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    for request in requests:
        core.add_request(request)
    added()
    while core.has_unfinished():
        for out in core.step()[0]:
            outputs[out.request_id].append(out)
    return outputs


def token_ids(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.fixture
def baseline(core) -> dict[int, list[int]]:
    """Greedy tokens of prompts(3), each run alone."""
    return {i: token_ids(run(core, [Request(f"alone-{i}", p, SamplingParams(**GREEDY))])[f"alone-{i}"])
            for i, p in enumerate(prompts(3))}


def batch(tag: str) -> list[Request]:
    return [Request(f"{tag}-{i}", p, SamplingParams(**GREEDY)) for i, p in enumerate(prompts(3))]


def assert_only_the_first_failed(outs: dict[str, list], baseline: dict[int, list[int]], what: str) -> None:
    first, *others = outs.values()
    assert first[-1].finish_reason == "error" and what in first[-1].error
    for i, other in enumerate(others, start=1):
        assert other[-1].finish_reason == "length" and token_ids(other) == baseline[i]


# ---- sampling

@pytest.mark.parametrize("field, value", [("temperature", math.nan), ("temperature", math.inf),
                                          ("top_p", math.nan)])
def test_non_finite_sampling_values_are_rejected(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        SamplingParams(**{field: value})


def test_a_row_whose_sampling_fails_fails_alone(core, baseline):
    requests = batch("nan")
    requests[0].params.temperature = math.nan  # past validation: multinomial raises on its row only
    outs = run(core, requests)
    assert_only_the_first_failed(outs, baseline, "sampling failed")
    assert_blocks_released(core)


def test_a_seeded_generator_is_built_on_the_logits_device(core, monkeypatch):
    built = []
    real = torch.Generator

    def recording_generator(device=None):
        built.append(device)
        return real(device=device or "cpu")

    monkeypatch.setattr(torch, "Generator", recording_generator)
    request = Request("seeded", prompts(1)[0], SamplingParams(max_tokens=3, temperature=1.0, seed=5, ignore_eos=True))
    outs = run(core, [request])
    assert outs["seeded"][-1].finish_reason == "length"
    assert built == [core.device]  # once, lazily, where the logits are (a CPU generator fails CUDA logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_sampling_on_cuda(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, device="cuda", dtype="float32")
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in (3, 3, 4)]
    a, b, c = llm.generate([prompts(1)[0]] * 3, params)
    assert a.finish_reason == "length" and a.token_ids == b.token_ids != c.token_ids


# ---- everything else a step does for one request

def test_a_failure_caching_one_requests_blocks_fails_it_alone(core, baseline, monkeypatch):
    requests = batch("cache")
    cache_full_blocks = core.kv.cache_full_blocks

    def failing(request):
        if request is requests[0] and request.output_token_ids:
            raise RuntimeError("block caching bug")
        cache_full_blocks(request)

    monkeypatch.setattr(core.kv, "cache_full_blocks", failing)
    outs = run(core, requests)
    assert_only_the_first_failed(outs, baseline, "block caching bug")
    assert_blocks_released(core)


def test_a_detokenizer_failure_fails_its_request_alone(core, baseline):
    requests = batch("detok")

    def break_the_first_detokenizer():
        detokenizer = core.detokenizers[requests[0].request_id]

        def failing(token_ids):
            if len(token_ids) == 3:
                raise RuntimeError("detokenizer bug")
            return type(detokenizer).update(detokenizer, token_ids)

        detokenizer.update = failing

    outs = run(core, requests, added=break_the_first_detokenizer)
    assert_only_the_first_failed(outs, baseline, "detokenizer bug")
    assert len(requests[0].output_token_ids) == 3
    assert_blocks_released(core)


def test_a_failing_stop_check_fails_its_request_alone(core, baseline):
    class ExplodingStopTokens(list):
        def __contains__(self, token_id):
            raise RuntimeError("stop check bug")

    requests = batch("stop")
    requests[0].params.stop_token_ids = ExplodingStopTokens()
    outs = run(core, requests)
    assert_only_the_first_failed(outs, baseline, "stop check bug")
    assert_blocks_released(core)


# ---- what breaks a whole step

def test_a_scheduling_failure_fails_the_requests_and_the_engine_goes_on(core, baseline, monkeypatch):
    requests = batch("sched")
    allocate, calls = core.kv.allocate, []

    def failing_allocate(request, num_new_tokens, prefix=None):
        calls.append(request.request_id)
        if len(calls) == 2:  # mid-admission: the first request is running, the second half admitted
            raise RuntimeError("scheduler bug")
        return allocate(request, num_new_tokens, prefix)

    monkeypatch.setattr(core.kv, "allocate", failing_allocate)
    outs = run(core, requests)
    assert all(o[-1].finish_reason == "error" and "scheduling failed" in o[-1].error for o in outs.values())
    assert not core.scheduler.running and not core.scheduler.waiting
    assert_blocks_released(core)
    again = run(core, batch("after"))  # the engine goes on
    assert [token_ids(o) for o in again.values()] == [baseline[i] for i in range(3)]


def test_a_failing_forward_pass_fails_its_batch(core, monkeypatch):
    def failing_execute(chunks):
        raise RuntimeError("kernel bug")

    monkeypatch.setattr(core.runner, "execute", failing_execute)
    outs = run(core, batch("forward"))
    assert all(o[-1].finish_reason == "error" and "kernel bug" in o[-1].error for o in outs.values())
    assert_blocks_released(core)


# ---- latencies observed when they happen

def test_step_stats_carry_the_latencies_of_the_tokens_they_produced(core):
    request = Request("timed", prompts(1)[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    core.add_request(request)
    per_step = []
    while core.has_unfinished():
        outputs, stats = core.step()
        per_step.append((len(stats.ttfts), len(stats.prefill_times), len(stats.inter_token_latencies),
                         [o.finished for o in outputs]))
    # the first token's TTFT is reported by the step that made it, long before the request finishes
    assert per_step == [(1, 1, 0, [False]), (0, 0, 1, [False]), (0, 0, 1, [False]), (0, 0, 1, [True])]


# ---- start-up checks

def test_a_step_budget_below_max_num_seqs_is_refused():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=8, max_num_seqs=16)
    EngineConfig(max_num_batched_tokens=16, max_num_seqs=16)
