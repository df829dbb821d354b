"""A prompt's logprobs through HTTP, as lm-evaluation-harness and vLLM's clients ask for them: completions' echo with
logprobs (max_tokens 1, or 0: the prompt alone), streamed too, and vLLM's prompt_logprobs on chat and completions;
transformers' numbers, whatever the prefix cache holds."""
from __future__ import annotations

import json

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from bench.engine_faults import assert_blocks_released
from tests.support.gateway_helpers import LiveServer, is_error_body, tiny_settings


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir, engine={"max_num_batched_tokens": 32})) as live:
        yield live


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _prompt(hf, n: int = 50, seed: int = 5) -> list[int]:
    return torch.randint(3, hf.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _expected(hf, prompt: list[int]) -> list[float]:
    """transformers' logprob of each prompt token after the first."""
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


def post(server, path: str, **body) -> requests.Response:
    return requests.post(f"{server.url}{path}", json={"model": server.state.model_name, **body}, timeout=60)


def completion(server, **body) -> dict:
    resp = post(server, "/v1/completions", **body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_lm_eval_loglikelihood_request_scores_the_prompt_past_the_cache(server, hf):
    """lm-evaluation-harness's loglikelihood payload (token ids, max_tokens 1, logprobs 1, echo): every prompt token
    with transformers' logprob, the first with none; read as lm-eval reads it. Cached blocks are not read."""
    prompt = _prompt(hf)
    completion(server, prompt=prompt, max_tokens=1, temperature=0)  # caches the prompt's blocks
    body = completion(server, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0, seed=1234)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) + 1 == len(logprobs["text_offset"])
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:-1] == pytest.approx(_expected(hf, prompt), abs=1e-4)
    ctxlen = 30  # lm-eval's sum over the continuation (the prompt's tail) and its greedy check
    continuation = logprobs["token_logprobs"][ctxlen:-1]
    assert sum(continuation) == pytest.approx(sum(_expected(hf, prompt)[ctxlen - 1:]), abs=1e-3)
    for token_logprob, top in zip(continuation, logprobs["top_logprobs"][ctxlen:-1]):
        assert len(top) == 1 and token_logprob <= max(top.values()) + 1e-6
    plain = completion(server, prompt=prompt, max_tokens=1, temperature=0)  # the scoring request wrote the cache
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(prompt) - 1) // 16 * 16


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, hf):
    prompt = _prompt(hf, 20)
    body = completion(server, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(_expected(hf, prompt), abs=1e-4)
    assert choice["logprobs"]["top_logprobs"] is None  # logprobs 0: the tokens' own
    assert len(choice["logprobs"]["tokens"]) == len(prompt)
    text = completion(server, prompt="the sky is blue", max_tokens=0, echo=True)["choices"][0]
    assert text["text"] == "the sky is blue" and text["logprobs"] is None
    refused = post(server, "/v1/completions", prompt=prompt, max_tokens=0)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def _stream(server, **body) -> list[dict]:
    resp = post(server, "/v1/completions", stream=True, **body)
    assert resp.status_code == 200, resp.text
    return [json.loads(line[6:])["choices"][0] for line in (raw.decode() for raw in resp.iter_lines())
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]]


@pytest.mark.parametrize("max_tokens", [0, 6])
def test_a_streamed_echo_with_logprobs_is_the_whole_answers(server, max_tokens):
    body = dict(prompt="the quick brown fox jumps", max_tokens=max_tokens, logprobs=2, echo=True, temperature=0,
                ignore_eos=True)
    whole = completion(server, **body)["choices"][0]
    chunks = _stream(server, **body)
    assert chunks[0]["text"].startswith("the quick brown fox jumps")  # the echo comes first, with its logprobs
    assert "".join(c["text"] for c in chunks) == whole["text"]
    joined = {key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]]
              for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined == whole["logprobs"]
    assert chunks[-1]["finish_reason"] == whole["finish_reason"] == "length"


def test_vllm_prompt_logprobs_on_chat_and_completions(server, hf, tiny_llama_dir):
    messages = [{"role": "user", "content": "name three colours"}]
    chat = post(server, "/v1/chat/completions", messages=messages, max_tokens=3, prompt_logprobs=2)
    assert chat.status_code == 200, chat.text
    body = chat.json()
    ids = post(server, "/tokenize", messages=messages).json()["tokens"]
    scores = body["prompt_logprobs"]
    assert len(scores) == len(ids) == body["usage"]["prompt_tokens"] and scores[0] is None
    expected = _expected(hf, ids)
    for token_id, position, logprob in zip(ids[1:], scores[1:], expected):
        own = position[str(token_id)]
        assert own["logprob"] == pytest.approx(logprob, abs=1e-4) and own["rank"] >= 1
        assert sorted(s["rank"] for s in position.values())[:2] == [1, 2]
        assert all(isinstance(s["decoded_token"], str) for s in position.values())
        assert len(position) in (2, 3)  # the prompt's token, and the top 2 (it may be one of them)
    choice = completion(server, prompt=ids, max_tokens=2, prompt_logprobs=0)["choices"][0]
    assert [list(p.values())[0]["logprob"] for p in choice["prompt_logprobs"][1:]] == pytest.approx(expected, abs=1e-4)
    assert "prompt_logprobs" not in completion(server, prompt=ids, max_tokens=2)["choices"][0]
    streamed = post(server, "/v1/chat/completions", messages=messages, prompt_logprobs=1, stream=True)
    assert streamed.status_code == 400 and is_error_body(streamed.json())
    assert streamed.json()["error"]["param"] == "prompt_logprobs"
    for bad in (-1, 1000, "2"):
        resp = post(server, "/v1/completions", prompt="hi", prompt_logprobs=bad)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"


def test_every_block_is_back_after_scoring(server):
    completion(server, prompt=["one two three", "four five"], max_tokens=2, logprobs=1, echo=True, n=2)
    completion(server, prompt="six seven", max_tokens=0, echo=True, logprobs=3, best_of=2, n=1)
    assert_blocks_released(server.state.engine)


def test_tokenizer_info_as_lm_eval_reads_it(server, tiny_llama_dir):
    """lm-evaluation-harness's check for a remote tokenizer: /tokenizer_info with an eos_token, then /tokenize; its
    eos_token_id is the first token of the EOS text."""
    info = requests.get(f"{server.url}/tokenizer_info", timeout=30).json()
    config = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    assert info["eos_token"] == config["eos_token"] and info["model_max_length"] == server.state.engine.max_model_len
    assert "{%" in info["chat_template"] and info["tokenizer_class"]
    eos = post(server, "/tokenize", prompt=info["eos_token"], add_special_tokens=False).json()["tokens"]
    assert eos[0] in server.state.engine.tokenizer.eos_token_ids


def test_echo_beside_best_of_without_logprobs_shows_none(server):
    """best_of ranks by logprobs asked for internally: an echo without logprobs shows none, of the prompt or the
    answer; with prompt_logprobs, vLLM's list alone."""
    choice = completion(server, prompt="one two", max_tokens=2, echo=True, best_of=2)["choices"][0]
    assert choice["logprobs"] is None and choice["text"].startswith("one two")
    choice = completion(server, prompt="one two", max_tokens=2, echo=True, best_of=2, prompt_logprobs=1)["choices"][0]
    assert choice["logprobs"] is None and len(choice["prompt_logprobs"]) >= 2


def test_echoed_special_tokens_have_the_width_the_echoed_text_gives_them(server):
    """A text prompt that writes a special token echoes its text, and its offsets count it; a token-id prompt's echo
    (decoded, special tokens left out) gives it none. Every token's offset points at its own text."""
    tok = server.state.engine.tokenizer
    special = next(iter(sorted(tok.special_token_ids)))
    name = tok.token_bytes(special).decode()
    prompt = f"{name}user hello{name}"
    for sent in (prompt, tok.encode(prompt)):
        choice = completion(server, prompt=sent, max_tokens=2, echo=True, logprobs=1, temperature=0)["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
        assert text.startswith(name if isinstance(sent, str) else "user hello")
        for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
            if not token.startswith("bytes:"):  # (part of a character)
                assert token == name or text.startswith(token, offset), (token, offset, text)


def test_a_prompt_that_generates_nothing_still_fits_the_kv_pool(tiny_llama_dir):
    """A KV pool of 4 blocks of 16 sets the context at 64 tokens: a prompt that generates nothing holds K/V for every
    one of them, scored or embedded (the context was 65, since a request never holds K/V for its last generated
    token; such a prompt of 65 was taken and never finished, and the queue behind it waited for ever)."""
    with LiveServer(tiny_settings(tiny_llama_dir, engine={"num_kv_blocks": 4})) as small:
        assert small.state.engine.max_model_len == 64
        for path, field, extra in (("/v1/completions", "prompt", {"max_tokens": 0, "echo": True, "logprobs": 0}),
                                   ("/v1/embeddings", "input", {})):
            over = post(small, path, **{field: list(range(3, 68))}, **extra)
            assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
            assert post(small, path, **{field: list(range(3, 67))}, **extra).status_code == 200  # 64 tokens
        cut = post(small, "/v1/completions", prompt=list(range(3, 83)), max_tokens=0, echo=True,
                   truncate_prompt_tokens=-1)  # as many as fit: all 64, nothing to generate
        assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 64
        assert post(small, "/v1/completions", prompt="hello", max_tokens=2).status_code == 200
        assert_blocks_released(small.state.engine)
