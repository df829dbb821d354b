"""Sampler and request options: seeds, top-k/top-p, logprobs, stop tokens and stop strings."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from bench.tiny_models import build_llama3_tiktoken_model
from engine import LLM, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling import Sampler, _draw, _filtered_probs, _top_p


@dataclass
class History:
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    matcher: None = None


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=128)


def _prompt(llm) -> list[int]:
    return llm.tokenizer.encode("the capital of France is Paris. what is the capital of France?")


def test_same_seed_same_output_different_seed_differs(llm):
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True) for s in (7, 7, 8)]
    a, b, c = llm.generate([_prompt(llm)] * 3, params)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(_prompt(llm), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    top1 = llm.generate(_prompt(llm), SamplingParams(max_tokens=16, temperature=1.5, top_k=1, seed=3,
                                                     ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_filtered_probs_top_p_keeps_smallest_head():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = _filtered_probs(logits, top_k=0, top_p=0.8)
    assert probs.tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])
    assert _filtered_probs(logits, top_k=2, top_p=1.0).tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])


def _top_p_by_sorting(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition: the whole vocabulary sorted, the smallest head whose mass reaches top_p kept."""
    sorted_probs, order = probs.sort(descending=True)
    drop = sorted_probs.cumsum(0) - sorted_probs >= top_p
    drop[0] = False
    sorted_probs[drop] = 0.0
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


@pytest.mark.parametrize("scale", [0.05, 1.0, 5.0, 40.0])  # flat (the candidates grow to all) to one-token peaked
@pytest.mark.parametrize("top_p", [0.0, 0.1, 0.5, 0.9, 0.99, 0.9999])
def test_top_p_keeps_the_head_that_sorting_keeps(scale, top_p):
    generator = torch.Generator().manual_seed(int(scale * 100) + int(top_p * 10000))
    probs = torch.softmax(torch.randn(5000, generator=generator) * scale, dim=-1)
    assert torch.equal(_top_p(probs, top_p), _top_p_by_sorting(probs, top_p))


def test_a_draw_takes_only_kept_tokens_at_their_rates_and_a_lone_one_always():
    probs = torch.zeros(1000)
    probs[[3, 500, 999]] = torch.tensor([0.2, 0.5, 0.3])
    generator = torch.Generator().manual_seed(0)
    draws = [_draw(probs, generator) for _ in range(6000)]
    assert set(draws) == {3, 500, 999}
    for token, rate in ((3, 0.2), (500, 0.5), (999, 0.3)):  # within 4 standard deviations (about 0.025)
        assert abs(draws.count(token) / len(draws) - rate) < 0.025
    probs = torch.zeros(1000)
    probs[777] = 1.0
    assert _draw(probs, generator) == 777
    again = torch.Generator().manual_seed(0)
    assert [_draw(probs, again) for _ in range(3)] == [777] * 3


def test_a_draw_of_probabilities_that_are_not_finite_or_all_zero_raises():
    for probs in (torch.full((10,), math.nan), torch.zeros(10)):
        with pytest.raises(ValueError, match="cannot sample"):
            _draw(probs, None)


def test_greedy_rows_pick_the_first_of_equal_maxima_as_torch_does():
    """The CPU sampler takes numpy's argmax: the same ids as torch's, ties (the first wins), NaN and
    all -inf rows included, float32 and bfloat16 logits alike."""
    logits = torch.randn(6, 300)
    logits[1, [7, 200]] = 50.0  # a tie
    logits[2, 9] = float("nan")
    logits[3] = float("-inf")
    logits[4, 299] = 1e30
    for rows in (logits, logits.bfloat16()):
        picked = Sampler()(rows, [SamplingParams(temperature=0.0)] * 6, [None] * 6)
        assert [t.token_id for t in picked] == rows.float().argmax(dim=-1).tolist()
        assert picked[1].token_id == 7 and picked[2].token_id == 9 and picked[3].token_id == 0


def test_greedy_ids_of_the_step_are_taken_where_no_processor_changed_the_logits():
    """The compiled step hands its rows' argmax along: greedy rows take it as it is, but not where a logits
    processor (here a logit bias) made new logits, nor for a sampled row."""
    logits = torch.zeros(3, 10)
    logits[:, 4] = 1.0
    given = np.array([7, 7, 7])  # not the argmax (4): which rows took them shows
    params = [SamplingParams(temperature=0.0)] * 2 + [SamplingParams(temperature=1.0, top_k=1)]
    history = [History(), History(), History()]
    picked = Sampler()(logits, params, [None] * 3, history, greedy_ids=given)
    assert [t.token_id for t in picked] == [7, 7, 4]
    biased = [SamplingParams(temperature=0.0, logit_bias={2: 0.5})] + params[1:]
    picked = Sampler()(logits, biased, [None] * 3, history, greedy_ids=given)
    assert [t.token_id for t in picked] == [4, 4, 4]


def test_logprobs_are_those_of_the_chosen_tokens():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    out = Sampler()(logits, [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0)], [None, None])
    expected = torch.log_softmax(logits[0], -1)
    assert out[0].token_id == 1 and out[0].logprob == pytest.approx(expected[1].item())
    assert [t for t, _ in out[0].top_logprobs] == [1, 2]
    assert out[1].logprob is None


def test_logprobs_through_the_engine(llm):
    out = llm.generate(_prompt(llm), SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for lp in out.logprobs:
        assert lp.top_logprobs[0][0] == lp.token_id  # greedy picks the top token
        assert lp.logprob <= 0 and math.isclose(lp.logprob, lp.top_logprobs[0][1])


def test_stop_token_ids_and_max_tokens(llm):
    free = llm.generate(_prompt(llm), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    stopped = llm.generate(_prompt(llm), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                        stop_token_ids=[stop_at]))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first + 1]


def test_stop_string_cuts_the_text(llm):
    free = llm.generate(_prompt(llm), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    stop = free.text[5:8]
    out = llm.generate(_prompt(llm), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:free.text.index(stop)]


class _CharTokenizer:
    """One character per token id (ord), to drive the detokenizer exactly."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_detokenizer_holds_back_a_possible_stop_string():
    detok = IncrementalDetokenizer(_CharTokenizer(), ["STOP"])
    ids, released = [], []
    for ch in "abcSTO":
        ids.append(ord(ch))
        assert not detok.update(ids)
        released.append(detok.take(finished=False))
    assert "".join(released) == "abc"  # "STO" may still become "STOP"
    ids.append(ord("P"))
    assert detok.update(ids)
    assert detok.take(finished=True) == ""
    assert detok.text == "abc"


def test_tiktoken_backend_round_trips_and_generates(tiny_tiktoken_dir):
    llm = LLM(str(tiny_tiktoken_dir), num_kv_blocks=32)
    assert llm.tokenizer.encode("<|endoftext|>") != [100257]  # user text never smuggles in a special token
    text = "Hello, world! The capital of France is Paris."
    ids = llm.tokenizer.encode(text)
    assert llm.tokenizer.decode(ids) == text
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.endswith("<|im_start|>assistant\n")
    out = llm.generate(text, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_llama3_tiktoken_file_backend(tmp_path):
    llm = LLM(str(build_llama3_tiktoken_model(tmp_path)), num_kv_blocks=32)
    tok = llm.tokenizer
    text = "Paris is the capital."
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text.encode())  # merges applied
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    chat_ids = tok.encode(chat)
    assert chat_ids[0] == 256 + 11  # <|begin_of_text|> is one special token, right after the 267 ranks
    assert tok.decode(chat_ids) == "user\n\nhiassistant\n\n"  # special tokens are not output text
    assert tok.eos_token_ids == {267 + 1, 267 + 9}  # <|end_of_text|>, <|eot_id|>
    assert tok.bos_token_ids == (267,)  # a text prompt starts with <|begin_of_text|>, as Meta's encode(bos=True)
    info = tok.info()  # (GET /tokenizer_info)
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<|begin_of_text|>", "<|end_of_text|>", None)
    assert tok.encode(info["eos_token"])[0] in tok.eos_token_ids and "{%" in info["chat_template"]
    assert llm.generate(text, SamplingParams(max_tokens=1))[0].prompt_token_ids == [267, *ids]
    out = llm.generate(chat_ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
