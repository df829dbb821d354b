"""Structured outputs in the engine: the grammar mask makes a random model's output valid."""
from __future__ import annotations

import json
import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.logits_processors import process_logits
from engine.grammar import GrammarCache, allocate_bitmask, apply_bitmask
from engine.structured import StructuredOutput, build_grammar

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"]}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=256)


def _prompt(llm, text: str = "the capital of France is Paris. what is the capital of France?") -> list[int]:
    return llm.tokenizer.encode(text)


def _run(llm, so: StructuredOutput, **params):
    params = {"max_tokens": 64, "temperature": 0, **params}
    return llm.generate(_prompt(llm), SamplingParams(structured=so, **params))[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_is_valid_and_stops(llm, temperature):
    out = _run(llm, StructuredOutput("json_schema", json.dumps(SCHEMA)), temperature=temperature, seed=3)
    value = json.loads(out.text)
    assert set(value) == {"color", "ok"} and value["color"] in ("red", "green") and isinstance(value["ok"], bool)
    assert out.finish_reason == "stop"


def test_json_object_is_parseable(llm):
    out = _run(llm, StructuredOutput("json_object"), temperature=1.0, seed=11)
    assert isinstance(json.loads(out.text), dict) and out.finish_reason == "stop"


def test_regex_and_choice_and_grammar(llm):
    pattern = r"[a-z]{3,8}@[a-z]{2,5}\.com"
    assert re.fullmatch(pattern, _run(llm, StructuredOutput("regex", pattern)).text)
    choices = ["Paris", "London", "the capital"]
    assert _run(llm, StructuredOutput("choice", json.dumps(choices))).text in choices
    ebnf = 'root ::= "yes" | "no" | digits\ndigits ::= [0-9] [0-9]'
    assert re.fullmatch(r"yes|no|[0-9]{2}", _run(llm, StructuredOutput("grammar", ebnf)).text)


def test_structured_row_leaves_free_rows_unchanged(llm):
    """A grammar-masked request batched with free ones: the free ones' greedy tokens are those of a run
    without it."""
    prompts = [_prompt(llm, t) for t in ("the world is", "a cache block", "hello world the", "she said what")]
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(prompts, [free] * 4)
    constrained = SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutput(
        "json_schema", json.dumps(SCHEMA)))
    mixed = llm.generate(prompts + [_prompt(llm)], [free] * 4 + [constrained])
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]
    assert json.loads(mixed[4].text)["color"] in ("red", "green")


def test_without_grammar_the_model_is_not_json(llm):
    """The control: the same request unconstrained is not the schema's JSON (so the mask does the work)."""
    out = llm.generate(_prompt(llm), SamplingParams(max_tokens=24, temperature=0))[0]
    with pytest.raises(ValueError):
        json.loads(out.text)


@pytest.mark.parametrize("so, message", [
    (StructuredOutput("json_schema", '{"type": "nope"}'), "invalid json_schema"),
    (StructuredOutput("json_schema", "not json"), "invalid json_schema: the schema is not JSON"),
    (StructuredOutput("regex", "a(b"), "invalid regex"),
    (StructuredOutput("choice", "[1, 2]"), "invalid choice"),
    (StructuredOutput("choice", "nope"), "invalid choice"),
    (StructuredOutput("grammar", "root ::= ("), "invalid grammar"),
])
def test_invalid_spec_is_a_value_error(llm, so, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_grammar(so)
    with pytest.raises(ValueError, match=re.escape(message)):
        _run(llm, so)
    assert not llm.core.has_unfinished()


def test_structured_output_kind_is_checked():
    with pytest.raises(ValueError, match="unknown structured output kind"):
        StructuredOutput("yaml", "x")
    with pytest.raises(ValueError, match="needs its spec"):
        StructuredOutput("regex")


def test_grammar_cache_compiles_once_and_is_bounded(llm):
    cache = GrammarCache(llm.tokenizer, llm.core.vocab_size, max_entries=2)
    specs = [StructuredOutput("choice", json.dumps([w])) for w in ("a", "b", "c")]
    first = cache.matcher(specs[0])
    assert cache.matcher(specs[0]) is not first and len(cache) == 1  # one compiled grammar, fresh matchers
    cache.matcher(specs[1])
    cache.matcher(specs[0])  # touched: specs[1] is now the least recently used
    cache.matcher(specs[2])
    assert list(cache._fresh) == [specs[0], specs[2]]


def test_matchers_from_the_cache_do_not_share_state(llm):
    cache = llm.core.grammars
    so = StructuredOutput("choice", json.dumps(["yes", "no"]))
    a, b = cache.matcher(so), cache.matcher(so)
    for token in llm.tokenizer.encode("yes"):
        a.accept(token)
    assert a.is_terminated and not b.is_terminated


def test_bitmask_bits_map_to_token_ids():
    logits = torch.zeros(3, 70)
    bitmask = allocate_bitmask(2, 70)
    bitmask[0] = 0
    bitmask[0, 0] = 1 << 5  # token 5
    bitmask[0, 2] = 1  # token 64
    apply_bitmask(logits, [1, 2], bitmask)  # rows 1 and 2 of the batch; row 2's mask allows everything
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [5, 64]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


def test_no_processing_when_no_row_asks():
    logits = torch.randn(2, 10)
    params = [SamplingParams(), SamplingParams(temperature=0)]
    assert process_logits(logits, params, [None, None], frozenset()) is logits


def test_tiktoken_backend_structured(tiny_tiktoken_dir):
    llm = LLM(str(tiny_tiktoken_dir), num_kv_blocks=64)
    out = llm.generate("Paris", SamplingParams(max_tokens=48, temperature=0, structured=StructuredOutput(
        "json_schema", json.dumps(SCHEMA))))[0]
    assert json.loads(out.text)["color"] in ("red", "green") and out.finish_reason == "stop"


@pytest.mark.slow
def test_structured_bench_runs_every_case(tiny_llama_dir):
    from bench import structured
    result = structured.run(str(tiny_llama_dir), rounds=1, steps=3)
    assert set(result["cases"]) == {0, 1, 8} and result["steps_per_case"] == 3
    assert "constrained" in structured.render(result)


@pytest.mark.parametrize("where", ["fill_bitmask", "accept"])
def test_a_grammar_that_gives_up_fails_its_request_alone_as_its_own(llm, monkeypatch, where):
    """llguidance's lazy lexer can give up at any token (a mask it cannot compute, or a token it then refuses):
    the request ends with an error marked as its own (the API's 400), its batch-mates run on."""
    from engine.grammar import GrammarError, StructuredMatcher
    from engine.request import Request

    original, calls = getattr(StructuredMatcher, where), []

    def gives_up_second_time(self, *args):
        calls.append(where)
        if len(calls) > 1:
            raise GrammarError("the output constraint failed: lexer error: too many expressions constructed")
        return original(self, *args)

    monkeypatch.setattr(StructuredMatcher, where, gives_up_second_time)
    core = llm.core
    core.add_request(Request("free", _prompt(llm, "the world is"),
                             SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
    core.add_request(Request("constrained", _prompt(llm), SamplingParams(
        max_tokens=20, temperature=0, structured=StructuredOutput("regex", "[a-z]{30}"))))
    finished = {}
    while core.has_unfinished():
        outputs, _ = core.step()
        finished.update({o.request_id: o for o in outputs if o.finished})
    constrained, free = finished["constrained"], finished["free"]
    assert constrained.finish_reason == "error" and constrained.error_is_request
    assert constrained.error == "the output constraint failed: lexer error: too many expressions constructed"
    assert free.finish_reason == "length" and not free.error_is_request and free.num_output_tokens == 6


def test_plain_added_tokens_reach_the_grammar_as_their_text_but_ends_and_special_ones_do_not():
    import json

    from engine.tokenizer import _plain_added_tokens_as_text

    added = [{"id": i, "content": text, "special": special} for i, text, special in (
        (5, "<x>", False), (6, "<tool_call>", False), (7, "<|im_end|>", False), (8, "<s>", True), (9, "a b", False),
        (10, "a", False))]
    spec = {"model": {"type": "BPE", "vocab": {"a": 0, "<x>": 5}}, "added_tokens": added}
    out = json.loads(_plain_added_tokens_as_text(json.dumps(spec), {7}))
    assert out["model"]["vocab"] == {"a": 0, "<x>": 5, "<tool_call>": 6}  # "a" keeps id 0's text
    assert [t["id"] for t in out["added_tokens"]] == [7, 8, 9, 10]  # an end, a special one, a space, a clash
    unigram = {"model": {"type": "Unigram", "vocab": [["a", 0.0]]}, "added_tokens": added}
    assert json.loads(_plain_added_tokens_as_text(json.dumps(unigram), set())) == unigram  # a BPE vocabulary only
