"""vLLM's request extras that shape an answer's end and its text, through HTTP against the real server on a tiny
model: stop_token_ids, include_stop_str_in_output, skip_special_tokens, allowed_token_ids, the choices'
stop_reason, and the extras this server cannot honour (400s naming them, never ignored)."""
from __future__ import annotations

import json

import pytest
import requests

from engine.tokenizer import load_tokenizer
from tests.support.gateway_helpers import LiveServer, is_error_body, tiny_settings


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with LiveServer(tiny_settings(tiny_llama_dir)) as live:
        yield live


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir, set())


def complete(server, **fields) -> dict:
    body = {"model": server.state.model_name, "prompt": "the capital of France", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, **fields}
    resp = requests.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def streamed(server, path: str, **fields) -> tuple[str, list[dict]]:
    """The text of a stream and its finish chunk's choice."""
    body = {"model": server.state.model_name, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True, **fields}
    resp = requests.post(f"{server.url}{path}", json=body, timeout=60, stream=True)
    assert resp.status_code == 200, resp.text
    lines = [line.decode() for line in resp.iter_lines()]
    choices = [json.loads(line[6:])["choices"] for line in lines
               if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [c[0] for c in choices if c]
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
    return text, choices


def test_a_stop_token_id_ends_the_answer_without_its_text(server, tok):
    words = tok.encode(" the capital of Spain is Madrid")  # whole words, so each token's text is its own
    free = complete(server, logprobs=0, allowed_token_ids=words)
    ids = [tok.encode(t) for t in free["logprobs"]["tokens"]]
    assert all(len(i) == 1 for i in ids)
    ids = [i[0] for i in ids]
    at = next(i for i, t in enumerate(ids) if i >= 1 and t not in ids[:i])  # a token's first time, not the first
    stopped = complete(server, stop_token_ids=[ids[at]], allowed_token_ids=words)
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == ids[at]
    assert stopped["text"] == tok.decode(ids[:at])
    kept = complete(server, stop_token_ids=[ids[at]], allowed_token_ids=words, include_stop_str_in_output=True)
    assert kept["text"] == tok.decode(ids[:at + 1]) and kept["stop_reason"] == ids[at]
    assert free["stop_reason"] is None and free["finish_reason"] == "length"


def test_a_stop_string_is_kept_with_include_stop_str_in_output(server, tok):
    free = complete(server)["text"]
    stop = free[4:7]
    cut = complete(server, stop=[stop, "never in the text"])
    assert cut["text"] == free[:free.index(stop)] and cut["stop_reason"] == stop
    kept = complete(server, stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == free[:free.index(stop) + len(stop)] and kept["stop_reason"] == stop
    words = tok.encode(" the capital of Spain is Madrid")
    for path, extra in (("/v1/completions", {"prompt": "the capital of France"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the capital"}]})):
        extra["allowed_token_ids"] = words
        whole = streamed(server, path, **extra)[0]
        stop = whole[4:7]
        text, choices = streamed(server, path, **extra, stop=[stop], include_stop_str_in_output=True)
        assert text == whole[:whole.index(stop) + len(stop)]
        assert choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] == stop


def test_special_tokens_show_when_skip_special_tokens_is_false(server, tok):
    start = tok.encode("<|im_start|>")
    assert len(start) == 1 and start[0] in tok.special_token_ids
    hidden = complete(server, allowed_token_ids=start, max_tokens=3)
    shown = complete(server, allowed_token_ids=start, max_tokens=3, skip_special_tokens=False)
    assert hidden["text"] == "" and shown["text"] == "<|im_start|>" * 3
    eos = sorted(tok.eos_token_ids)[0]  # EOS ends the answer and, as a stop token, is left out either way
    ended = complete(server, allowed_token_ids=[eos], ignore_eos=False, skip_special_tokens=False)
    assert ended["text"] == "" and ended["finish_reason"] == "stop" and ended["stop_reason"] is None
    ignored = complete(server, allowed_token_ids=[eos], ignore_eos=True, return_token_ids=True, max_tokens=3)
    assert ignored["finish_reason"] == "length" and ignored["token_ids"] == [eos] * 3


def test_allowed_token_ids_limit_every_sampled_token(server, tok):
    allowed = tok.encode(" the capital of Spain")
    for sampling in ({"temperature": 0}, {"temperature": 1.5, "seed": 7}):
        choice = complete(server, allowed_token_ids=allowed, logprobs=0, **sampling)
        tokens = choice["logprobs"]["tokens"]
        assert len(tokens) == 12 and {tok.encode(t)[0] for t in tokens} <= set(allowed)


@pytest.mark.parametrize("field, value", [
    ("bad_words", ["Paris"]), ("use_beam_search", True),
    ("logits_processors", ["my.module:Processor"]), ("priority", 5), ("stop_token_ids", [10**6]),
    ("guided_whitespace_pattern", r"[ ]?"), ("structural_tag", '{"structures": []}'),
    ("priority", False), ("use_beam_search", 0),  # a boolean is not 0, nor 0 False: neither asks for nothing
    ("stop_token_ids", [1.5]), ("stop_token_ids", "2"), ("allowed_token_ids", []), ("allowed_token_ids", [-1]),
    ("include_stop_str_in_output", "yes"), ("skip_special_tokens", 1), ("spaces_between_special_tokens", "no"),
])
def test_extras_it_cannot_honour_or_read_are_400s_naming_them(server, field, value):
    for path, extra in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        resp = requests.post(f"{server.url}{path}", json={"model": server.state.model_name, "max_tokens": 2,
                                                          **extra, field: value}, timeout=60)
        assert resp.status_code == 400 and is_error_body(resp.json()), (path, field, value, resp.text)
        assert resp.json()["error"]["param"] == field


def test_allowed_token_ids_beside_an_output_constraint_is_a_400(server, tok):
    resp = requests.post(f"{server.url}/v1/chat/completions", json={
        "model": server.state.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "allowed_token_ids": tok.encode(" the"), "response_format": {"type": "json_object"}}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "allowed_token_ids"


@pytest.mark.parametrize("field, value", [("priority", 0), ("bad_words", []), ("use_beam_search", False),
                                          ("prompt_logprobs", None), ("spaces_between_special_tokens", False),
                                          ("stop_token_ids", [])])
def test_extras_that_ask_for_nothing_answer(server, field, value):
    assert complete(server, **{field: value})["finish_reason"] == "length"


# ---- chat template variables (chat_template_kwargs, documents)

THINKING_TEMPLATE = (  # a Qwen3-style switch, a RAG template's documents, a number it adds to, a message's name
    "{% if budget is defined %}budget {{ budget + 1 }}\n{% endif %}"
    "{% for d in documents or [] %}<|im_start|>document\n{{ d['title'] }}: {{ d['text'] }}<|im_end|>\n{% endfor %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}"
    "{{ ' (' + message.name + ')' if message.name is defined else '' }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
DOCS = [{"title": "France", "text": "Its capital is Paris."}]


@pytest.fixture(scope="module")
def thinking_server(tiny_llama_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("thinking-template")
    for path in tiny_llama_dir.iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    (model / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    with LiveServer(tiny_settings(model)) as live:
        yield live


def tokenized(server, **body) -> requests.Response:
    return requests.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}], **body},
                         timeout=60)


def test_a_messages_name_reaches_the_chat_template(thinking_server, tok):
    """As vLLM passes it (a template may show who speaks); dropped until 2026-12-01."""
    named = tokenized(thinking_server, messages=[{"role": "user", "name": "alice", "content": "hi"}]).json()
    assert "user (alice)\nhi" in tok.decode(named["tokens"])  # (its <|im_start|> a special token, not decoded)


def test_template_variables_reach_the_chat_template(thinking_server, tok):
    server = thinking_server
    plain = tokenized(server).json()["tokens"]
    no_think = tokenized(server, chat_template_kwargs={"enable_thinking": False}).json()["tokens"]
    assert tok.decode(no_think) == tok.decode(plain) + "<think>\n\n</think>\n\n"
    assert tokenized(server, chat_template_kwargs={"enable_thinking": True}).json()["tokens"] == plain
    with_docs = tokenized(server, documents=DOCS).json()["tokens"]
    assert tok.decode(with_docs).startswith("document\nFrance: Its capital is Paris.")
    body = {"model": server.state.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False}, "documents": DOCS}
    answer = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    both = tokenized(server, chat_template_kwargs={"enable_thinking": False}, documents=DOCS).json()["count"]
    assert answer["usage"]["prompt_tokens"] == both == len(plain) + (len(no_think) - len(plain)) + (
        len(with_docs) - len(plain))
    warmed = requests.post(f"{server.url}/v1/cache/warm", json={
        "messages": [{"role": "system", "content": "a system prompt " * 8}], "documents": DOCS}, timeout=60).json()
    assert warmed["usage"]["prompt_tokens"] == tokenized(server, messages=[
        {"role": "system", "content": "a system prompt " * 8}], documents=DOCS, add_generation_prompt=False).json()[
        "count"]


@pytest.mark.parametrize("body, param", [
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"documents": "x"}, "documents"), ({"documents": ["x"]}, "documents"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"chat_template_kwargs": {"budget": "many"}}, "messages"),  # the template's own TypeError: "many" + 1
])
def test_template_variables_it_cannot_use_are_400s(thinking_server, body, param):
    for path, extra in (("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 2}), ("/v1/cache/warm", {})):
        resp = requests.post(f"{thinking_server.url}{path}", json={
            "model": thinking_server.state.model_name, "messages": [{"role": "user", "content": "hi"}],
            **extra, **body}, timeout=60)
        assert resp.status_code == 400 and is_error_body(resp.json()) and resp.json()["error"]["param"] == param


def test_any_json_value_is_a_template_variable(thinking_server, tok):
    assert tok.decode(tokenized(thinking_server, chat_template_kwargs={"budget": 5}).json()["tokens"]).startswith(
        "budget 6\n")
    for value in ({"nested": [1, None]}, [1, 2], "text", None, 2.5):
        assert tokenized(thinking_server, chat_template_kwargs={"enable_thinking": value}).status_code == 200
    for name in ("self", "not an identifier", "bos_token"):  # any name: a template could read it
        assert tokenized(thinking_server, chat_template_kwargs={name: 1}).status_code == 200


def test_ping_and_version(server):
    for method in ("GET", "POST"):
        resp = requests.request(method, f"{server.url}/ping", timeout=60)
        assert resp.status_code == 200 and resp.json()["status"] == "ok"
    version = requests.get(f"{server.url}/version", timeout=60).json()
    assert version == {"version": requests.get(f"{server.url}/openapi.json", timeout=60).json()["info"]["version"]}
    assert version["version"].count(".") == 2


# ---- truncate_prompt_tokens

def post(server, path: str, **body) -> requests.Response:
    return requests.post(f"{server.url}{path}", json={"model": server.state.model_name, **body}, timeout=120)


def test_truncation_keeps_the_prompts_last_tokens(server, tok):
    ids = tok.encode("the capital of France is Paris and the capital of Spain is Madrid")
    cut = post(server, "/v1/completions", prompt=ids, max_tokens=3, temperature=0, echo=True,
               truncate_prompt_tokens=4).json()
    last = post(server, "/v1/completions", prompt=ids[-4:], max_tokens=3, temperature=0, echo=True).json()
    assert cut["usage"]["prompt_tokens"] == 4 and cut["choices"][0]["text"] == last["choices"][0]["text"]
    assert cut["choices"][0]["text"].startswith(tok.decode(ids[-4:]))  # echo: the prompt that was served
    chat = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hello there"}], max_tokens=2,
                truncate_prompt_tokens=5).json()
    assert chat["usage"]["prompt_tokens"] == 5
    whole = post(server, "/v1/embeddings", input=[ids[-3:]]).json()
    embedded = post(server, "/v1/embeddings", input=[ids], truncate_prompt_tokens=3).json()
    assert embedded["usage"]["prompt_tokens"] == 3 and embedded["data"][0]["embedding"] == whole["data"][0]["embedding"]


def test_truncation_to_as_many_as_fit(server, tok):
    limit = server.state.prompt_limit()
    too_long = (tok.encode(" the capital of France") * limit)[:limit + 40]
    assert post(server, "/v1/completions", prompt=too_long, max_tokens=1).status_code == 400
    fitted = post(server, "/v1/completions", prompt=too_long, truncate_prompt_tokens=-1)
    assert fitted.status_code == 200 and fitted.json()["usage"]["prompt_tokens"] == limit
    exact = post(server, "/v1/completions", prompt=too_long, truncate_prompt_tokens=limit)
    assert exact.status_code == 200 and exact.json()["usage"]["prompt_tokens"] == limit
    over = post(server, "/v1/completions", prompt=too_long, truncate_prompt_tokens=limit + 1)
    assert over.status_code == 400 and over.json()["error"]["param"] == "truncate_prompt_tokens"
    assert fitted.json()["usage"]["completion_tokens"] == 1  # the default max_tokens, clamped to the context left


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": -2}),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 10**6}),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 5, "cache_control": {"type": "ephemeral"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}], "truncate_prompt_tokens": 5}),
    ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": "5"}),
    ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 10**6}),
])
def test_truncation_it_cannot_do_is_a_400(server, path, body):
    resp = post(server, path, max_tokens=2, **body) if path != "/v1/embeddings" else post(server, path, **body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "truncate_prompt_tokens", resp.text


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_its_chunks(server):
    body = {"model": server.state.model_name, "prompt": "the capital", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    resp = requests.post(f"{server.url}/v1/completions", json=body, timeout=60)
    chunks = [json.loads(line[6:]) for line in resp.content.decode().split("\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    *choice_chunks, last = chunks
    prompt_tokens = last["usage"]["prompt_tokens"]  # one prompt, counted once
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    for index in (0, 1):
        counts = [c["usage"]["completion_tokens"] for c in choice_chunks if c["choices"][0]["index"] == index]
        assert counts == sorted(counts) and counts[-1] == 5
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in choice_chunks)
    body["stream_options"] = {"continuous_usage_stats": True}
    resp = requests.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream_options"


# ---- token ids beside the text

def test_return_token_ids_gives_the_prompts_and_the_answers_ids(server, tok):
    words = tok.encode(" the capital of Spain is Madrid")
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "allowed_token_ids": words,
            "return_token_ids": True}
    chat = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], **base).json()
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert tok.decode(chat["prompt_token_ids"], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert tok.decode(chat["choices"][0]["token_ids"]) == chat["choices"][0]["message"]["content"]
    done = post(server, "/v1/completions", prompt=["the capital", "of Spain"], **base).json()
    for choice, prompt in zip(done["choices"], ("the capital", "of Spain")):
        assert choice["prompt_token_ids"] == tok.encode(prompt) and tok.decode(choice["token_ids"]) == choice["text"]
    plain = post(server, "/v1/completions", prompt="the capital", max_tokens=2).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain

    for path, extra in (("/v1/completions", {"prompt": "the capital", "n": 2}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        body = {"model": server.state.model_name, "stream": True, **base, **extra}
        lines = requests.post(f"{server.url}{path}", json=body, timeout=60).content.decode().split("\n")
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
        whole = post(server, path, **{**base, **extra}).json()
        for index in range(len(whole["choices"])):
            mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
            assert [c.get("token_ids") for c in mine].count(None) <= 2  # the role chunk and the finish chunk
            assert sum((c.get("token_ids") or [] for c in mine), []) == whole["choices"][index]["token_ids"]
            if path == "/v1/completions":  # the prompt's ids in each choice's first chunk alone
                assert [("prompt_token_ids" in c) for c in mine] == [True] + [False] * (len(mine) - 1)
        if path == "/v1/chat/completions":
            assert [("prompt_token_ids" in c) for c in chunks] == [True] + [False] * (len(chunks) - 1)
            assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server, tok):
    chat = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True,
                return_token_ids=True).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(top["token"].startswith("token_id:") for c in content for top in c["top_logprobs"])
    done = post(server, "/v1/completions", prompt="the capital", max_tokens=4, temperature=0, ignore_eos=True,
                logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True).json()["choices"][0]
    assert done["logprobs"]["tokens"] == [f"token_id:{t}" for t in done["token_ids"]]
    assert all(key.startswith("token_id:") for top in done["logprobs"]["top_logprobs"] for key in top)


# ---- a tokenizer with a BOS (Llama's): text prompts start with it, as vLLM and transformers encode them

@pytest.fixture(scope="module")
def bos_model(tiny_llama_dir, tmp_path_factory):
    from tokenizers import Tokenizer, processors
    model = tmp_path_factory.mktemp("bos-model")
    for path in tiny_llama_dir.iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    backend = Tokenizer.from_file(str(model / "tokenizer.json"))
    bos = backend.token_to_id("<|endoftext|>")
    backend.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                                           special_tokens=[("<|endoftext|>", bos)])
    backend.save(str(model / "tokenizer.json"))
    return model, bos


@pytest.fixture(scope="module")
def bos_server(bos_model):
    with LiveServer(tiny_settings(bos_model[0])) as live:
        yield live


def test_the_tokenizers_bos_is_what_its_post_processor_adds(bos_model, tiny_llama_dir):
    model, bos = bos_model
    assert load_tokenizer(model, set()).bos_token_ids == (bos,)
    assert load_tokenizer(tiny_llama_dir, set()).bos_token_ids == ()


def test_text_prompts_start_with_the_bos_unless_asked_not_to(bos_server, bos_model):
    server, bos = bos_server, bos_model[1]
    tok = load_tokenizer(bos_model[0], set())
    text = "the capital of France"
    ids = tok.encode(text)
    served = [post(server, "/v1/completions", prompt=prompt, max_tokens=2, return_token_ids=True).json()
              for prompt in (text, ids)]
    assert [d["choices"][0]["prompt_token_ids"] for d in served] == [[bos, *ids], ids]  # token ids: as they are
    plain = post(server, "/v1/completions", prompt=text, max_tokens=2, return_token_ids=True,
                 add_special_tokens=False).json()
    assert plain["choices"][0]["prompt_token_ids"] == ids
    assert post(server, "/v1/embeddings", input=text).json()["usage"]["prompt_tokens"] == len(ids) + 1
    assert post(server, "/v1/embeddings", input=text, add_special_tokens=False).json()["usage"]["prompt_tokens"] == \
        len(ids)
    assert post(server, "/v1/cache/warm", prompt=text).json()["usage"]["prompt_tokens"] == len(ids) + 1
    counted = [post(server, "/tokenize", prompt=text, **extra).json()["tokens"]
               for extra in ({}, {"add_special_tokens": False})]
    assert counted == [[bos, *ids], ids]


def test_a_chat_gets_the_bos_only_when_asked(bos_server, bos_model):
    server, bos = bos_server, bos_model[1]
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 6, "cache_control":
                 {"type": "ephemeral"}}, {"role": "user", "content": "hi"}]
    rendered = post(server, "/tokenize", messages=messages).json()["tokens"]
    assert rendered[0] != bos
    assert post(server, "/tokenize", messages=messages, add_special_tokens=True).json()["tokens"] == [bos, *rendered]
    answers = [post(server, "/v1/chat/completions", messages=messages, max_tokens=2, return_token_ids=True,
                    add_special_tokens=special).json() for special in (False, True)]
    assert [a["prompt_token_ids"] for a in answers] == [rendered, [bos, *rendered]]
    pinned = [a["usage"]["prompt_tokens_details"]["pinned_tokens"] for a in answers]
    assert pinned[0] >= 32 and pinned[1] >= pinned[0]  # the system message's breakpoint, after the BOS too


def test_a_request_without_a_model_is_served_by_the_served_model(server):
    name = server.state.model_name
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}), ("/v1/embeddings", {"input": "hi"}),
                       ("/v1/responses", {"input": "hi"})):
        for model in ({}, {"model": ""}, {"model": None}):
            resp = requests.post(f"{server.url}{path}", json={**body, **model, "max_tokens": 2}
                                 if path != "/v1/responses" else {**body, **model, "max_output_tokens": 2}, timeout=60)
            assert resp.status_code == 200 and resp.json()["model"] == name, (path, model, resp.text)
        wrong = requests.post(f"{server.url}{path}", json={**body, "model": "gpt-0"}, timeout=60)
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"



def test_allowed_tokens_that_all_end_the_answer_cannot_wait_for_min_tokens(server, tok):
    eos = sorted(tok.eos_token_ids)[0]
    for extra in ({"allowed_token_ids": [eos]}, {"allowed_token_ids": [100], "stop_token_ids": [100]}):
        for temperature in (0, 1):
            resp = post(server, "/v1/completions", prompt="the capital", max_tokens=4, min_tokens=2,
                        temperature=temperature, **extra)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "allowed_token_ids", resp.text
    fine = post(server, "/v1/completions", prompt="the capital", max_tokens=4, min_tokens=2,
                allowed_token_ids=[eos, 100], return_token_ids=True).json()["choices"][0]
    assert fine["token_ids"][:2] == [100, 100] and set(fine["token_ids"]) <= {eos, 100}


def test_allowed_token_ids_beside_a_forced_tool_call_is_a_400(server):
    tool = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
    for choice in ("required", {"type": "function", "function": {"name": "get"}}):
        resp = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], tools=[tool],
                    tool_choice=choice, allowed_token_ids=[100], max_tokens=4)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "allowed_token_ids", resp.text


def test_text_offsets_count_special_tokens_text_when_it_is_shown(server, tok):
    start = tok.encode("<|im_start|>")
    for skip, offsets in ((True, [0, 0, 0]), (False, [0, 12, 24])):
        choice = post(server, "/v1/completions", prompt="the capital", max_tokens=3, allowed_token_ids=start,
                      logprobs=0, skip_special_tokens=skip).json()["choices"][0]
        assert choice["logprobs"]["text_offset"] == offsets


def test_an_empty_model_is_the_served_one_on_every_route(server):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [100]}),
                       ("/v1/cache/warm", {"prompt": "hi"}), ("/v1/responses/input_tokens", {"input": "hi"})):
        assert requests.post(f"{server.url}{path}", json={**body, "model": ""}, timeout=60).status_code == 200, path


def test_echo_of_a_prompt_the_truncation_did_not_cut_is_the_prompt_as_sent(server):
    prompt = "<|im_start|>hello  world"
    echoes = [post(server, "/v1/completions", prompt=prompt, max_tokens=1, echo=True, **extra).json()
              ["choices"][0]["text"] for extra in ({}, {"truncate_prompt_tokens": 50})]
    assert echoes[0].startswith(prompt) and echoes[1].startswith(prompt)


def test_a_stop_token_ends_the_answer_before_a_stop_string_its_own_text_completes(server, tok):
    token = next(t for t in tok.encode(" the capital of Spain is Madrid") if len(tok.decode([t]).strip()) >= 3)
    text = tok.decode([token])
    for include, expected in ((True, text), (False, "")):
        got = complete(server, allowed_token_ids=[token], stop_token_ids=[token], stop=[text.strip()[:2]],
                       include_stop_str_in_output=include)
        assert (got["text"], got["stop_reason"]) == (expected, token)  # as vLLM: stop tokens are checked first


def test_chat_echo_puts_the_continued_assistant_message_before_the_answer(server):
    """vLLM's echo on chat: the last message, an assistant's, starts the answer's content (streamed: in the role
    chunk); after a user's message, nothing is echoed."""
    prefill = "The capital of France is"
    base = {"model": server.state.model_name, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Name a capital."}, {"role": "assistant", "content": prefill}],
            "add_generation_prompt": False, "continue_final_message": True}
    plain = requests.post(f"{server.url}/v1/chat/completions", json=base, timeout=60).json()
    answer = plain["choices"][0]["message"]["content"]
    echoed = requests.post(f"{server.url}/v1/chat/completions", json={**base, "echo": True}, timeout=60).json()
    assert echoed["choices"][0]["message"]["content"] == prefill + answer
    assert [echoed["usage"][k] for k in ("prompt_tokens", "completion_tokens")] == [
        plain["usage"][k] for k in ("prompt_tokens", "completion_tokens")]  # the echo is no answer token
    text, choices = streamed(server, "/v1/chat/completions", **{k: v for k, v in base.items() if k != "model"},
                             echo=True)
    assert text == prefill + answer and choices[0]["delta"] == {"role": "assistant", "content": prefill}
    asked = {**base, "messages": base["messages"][:1], "add_generation_prompt": True, "continue_final_message": False}
    alone = requests.post(f"{server.url}/v1/chat/completions", json=asked, timeout=60).json()
    with_echo = requests.post(f"{server.url}/v1/chat/completions", json={**asked, "echo": True}, timeout=60).json()
    assert with_echo["choices"][0]["message"] == alone["choices"][0]["message"]
