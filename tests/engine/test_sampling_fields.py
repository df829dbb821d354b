"""logit_bias, allowed_token_ids, penalties, min_p, min_tokens: exact effects on crafted logits, and through the
engine."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from engine import LLM, SamplingParams
from engine.logits_processors import process_logits
from engine.request import Request
from engine.sampling import Sampler, _filtered_probs
from engine.sampling_params import validate_prompt

EOS = 3


@dataclass
class History:
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    matcher: None = None


def _greedy(logits: list[float], history: History | None = None, **params) -> int:
    sampler = Sampler(frozenset({EOS}))
    out = sampler(torch.tensor([logits]), [SamplingParams(temperature=0, **params)], [None], [history or History()])
    return out[0].token_id


def test_logit_bias_adds_to_the_logits():
    logits = [2.0, 1.0, 0.0, -1.0]
    assert _greedy(logits) == 0
    assert _greedy(logits, logit_bias={2: 2.5}) == 2  # 0 + 2.5 > 2
    assert _greedy(logits, logit_bias={2: 1.5}) == 0  # 0 + 1.5 < 2
    assert _greedy(logits, logit_bias={0: -100}) == 1  # -100 bans a token


def test_allowed_token_ids_mask_their_own_row_alone():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]])
    params = [SamplingParams(allowed_token_ids=(2, 3)), SamplingParams()]
    out = process_logits(logits, params, [History(), History()], frozenset())
    assert out[0].tolist() == [float("-inf"), float("-inf"), 0.0, -1.0] and out[1].tolist() == logits[1].tolist()
    assert _greedy([2.0, 1.0, 0.0, -1.0], allowed_token_ids=(3, 1)) == 1
    assert _greedy([2.0, 1.0, 0.0, -1.0], allowed_token_ids=(2,), logit_bias={0: 100}) == 2  # bias cannot undo it
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=())
    for params in (SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=(EOS,)),
                   SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=(1,), stop_token_ids=[1])):
        with pytest.raises(ValueError, match="before min_tokens"):  # every allowed token would be masked
            validate_prompt([0], params, 10, 100, {EOS})
    validate_prompt([0], SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=(EOS,), ignore_eos=True), 10,
                    100, {EOS})


def test_frequency_penalty_counts_every_occurrence_presence_only_once():
    logits = [2.0, 1.9, 0.0, -5.0]
    seen_three_times = History(output_token_ids=[0, 0, 0])
    # frequency: 2.0 - 3 * 0.06 = 1.82 < 1.9; presence: 2.0 - 0.06 = 1.94 > 1.9
    assert _greedy(logits, seen_three_times, frequency_penalty=0.06) == 1
    assert _greedy(logits, seen_three_times, presence_penalty=0.06) == 0
    assert _greedy(logits, History(output_token_ids=[0]), presence_penalty=0.2) == 1
    # OpenAI's penalties count generated tokens, not the prompt
    assert _greedy(logits, History(prompt_token_ids=[0, 0, 0]), frequency_penalty=2.0) == 0
    # a negative penalty encourages repetition
    assert _greedy([1.9, 2.0, 0, 0], History(output_token_ids=[0]), presence_penalty=-0.2) == 0


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output():
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.2, 0.5]])
    params = [SamplingParams(repetition_penalty=2.0)]
    out = process_logits(logits, params, [History(prompt_token_ids=[0, 2], output_token_ids=[2])], frozenset())[0]
    assert out.tolist() == pytest.approx([1.0, 1.5, -2.0, -1.2, 0.5])
    assert _greedy(logits[0].tolist(), History(prompt_token_ids=[0]), repetition_penalty=2.0) == 1
    assert _greedy(logits[0].tolist(), History(output_token_ids=[0]), repetition_penalty=2.0) == 1


def test_min_p_drops_tokens_below_a_share_of_the_top_one():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert _filtered_probs(logits, 0, 1.0, min_p=0.5).tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])
    assert _filtered_probs(logits, 0, 1.0, min_p=0.0).tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05])
    picks = {_sample(logits, min_p=0.5, seed=s) for s in range(40)}
    assert picks == {0, 1}


def _sample(logits: torch.Tensor, seed: int, **params) -> int:
    gen = torch.Generator().manual_seed(seed)
    return Sampler()(logits[None], [SamplingParams(temperature=1.0, **params)], [gen])[0].token_id


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = [0.0, 1.0, 5.0, 9.0]  # EOS (3) on top, stop id 2 next
    assert _greedy(logits, History(output_token_ids=[1]), min_tokens=2) == 2
    assert _greedy(logits, History(output_token_ids=[1]), min_tokens=2, stop_token_ids=[2]) == 1
    assert _greedy(logits, History(output_token_ids=[1, 1]), min_tokens=2) == EOS


def test_rows_without_fields_are_untouched():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 1.0, 2.0, 3.0]])
    params = [SamplingParams(logit_bias={1: 5}, repetition_penalty=1.5, frequency_penalty=1.0), SamplingParams()]
    history = [History([0, 1], [1]), History([0, 1, 2, 3], [3, 3])]
    out = process_logits(logits, params, history, frozenset({EOS}))
    assert out[1].tolist() == logits[1].tolist()
    assert out[0].tolist() != logits[0].tolist()


@pytest.mark.parametrize("fields, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in"),
    ({"frequency_penalty": -2.1}, "frequency_penalty must be in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty must be in"),
    ({"min_p": 1.5}, "min_p must be in"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be in"),
    ({"logit_bias": {5: 101}}, "logit_bias values must be in"),
    ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids"),
])
def test_out_of_range_fields_are_rejected(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


# ---- through the engine (tiny random model)

@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=128)


def _prompt(llm) -> list[int]:
    return llm.tokenizer.encode("the capital of France is Paris. what is the capital of France?")


def _gen(llm, **params):
    return llm.generate(_prompt(llm), SamplingParams(temperature=0, **params))[0]


def test_engine_min_tokens_defers_a_forced_eos(llm):
    eos = min(llm.tokenizer.eos_token_ids)
    forced = _gen(llm, max_tokens=16, logit_bias={eos: 100})
    assert forced.token_ids == [eos] and forced.finish_reason == "stop"
    deferred = _gen(llm, max_tokens=16, logit_bias={eos: 100}, min_tokens=5)
    assert len(deferred.token_ids) == 6 and deferred.token_ids[-1] == eos and deferred.finish_reason == "stop"


def test_engine_penalties_break_greedy_repetition(llm):
    free = _gen(llm, max_tokens=24, ignore_eos=True)
    assert len(set(free.token_ids)) < len(free.token_ids)  # the random model repeats itself
    for field_name, value in (("frequency_penalty", 2.0), ("presence_penalty", 2.0), ("repetition_penalty", 2.0)):
        out = _gen(llm, max_tokens=24, ignore_eos=True, **{field_name: value})
        assert out.token_ids != free.token_ids, field_name
        assert len(set(out.token_ids)) > len(set(free.token_ids)), field_name


def test_engine_logit_bias_token_id_beyond_the_vocab_is_refused(llm):
    with pytest.raises(ValueError, match="logit_bias token ids must be in"):
        _gen(llm, max_tokens=4, logit_bias={llm.core.vocab_size: 1})


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_prompt_token_ids_outside_the_vocab_are_refused(llm, bad):
    bad = llm.core.vocab_size if bad == "vocab" else bad
    with pytest.raises(ValueError, match=r"^token ids must be in \[0, "):
        llm.core.add_request(Request("bad", [1, 2, bad, 3], SamplingParams(max_tokens=2)))
    assert not llm.core.has_unfinished()
