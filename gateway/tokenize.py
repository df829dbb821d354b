"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, as vLLM serves them: a prompt's tokens as this
server counts them (a chat's through its template and tools, as /v1/chat/completions renders it; a text as
/v1/completions encodes it, after the tokenizer's BOS where it has one; `add_special_tokens` as vLLM takes it), token
ids back to text, and what the tokenizer is. A client that keeps a long chat within the context counts with them,
lm-evaluation-harness tokenizes with them; nothing reaches the engine."""
from __future__ import annotations

from aiohttp import web

from gateway.errors import invalid
from gateway.jsonbody import parse_body
from gateway.protocol import _Fields, prompt_ending
from gateway.render import decode, encode, render_body_chat, with_bos
from gateway.state import STATE, GatewayState
from gateway.tool_prompt import TOOL_TEMPLATE


async def tokenize(request: web.Request) -> web.Response:
    """Body: `prompt` (a text) or `messages` (with optional `tools`, `add_generation_prompt`,
    `continue_final_message` and template variables, as chat completions take them), optional `model`,
    `add_special_tokens` and `return_token_strs`. Answer:
    `count`, `max_model_len`, `tokens`, `token_strs` (each token's own text, U+FFFD where it holds part of a
    character; null unless asked for)."""
    state, fields = await _checked(request)
    body, tokenizer = fields.body, state.engine.tokenizer
    if (body.get("messages") is None) == (body.get("prompt") is None):
        raise invalid("send either prompt (a text) or messages (a chat, rendered by the model's template)",
                      "messages")
    want_strs = fields.boolean("return_token_strs", False)
    if body.get("prompt") is not None:  # as /v1/completions encodes it: after the tokenizer's BOS, if it has one
        tokens = await encode(tokenizer, fields.string("prompt", None), fields.boolean("add_special_tokens", True))
    else:
        *_, rendered = await render_body_chat(tokenizer, body, state.settings.gateway.max_messages,
                                              request.app[TOOL_TEMPLATE], *prompt_ending(fields))
        tokens = with_bos(tokenizer, rendered, fields.boolean("add_special_tokens", False))
    strs = [tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in tokens] if want_strs else None
    return web.json_response({"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens,
                              "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    """Body: `tokens` (token ids), optional `model`. Answer: `prompt`, their text, special tokens' included (as
    vLLM's: lm-evaluation-harness sends a scored prompt back as this text, which must encode to the same ids)."""
    state, fields = await _checked(request)
    tokens = fields.body.get("tokens")
    vocab = state.engine.tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid("tokens must be an array of token ids", "tokens")
    if any(not 0 <= t < vocab for t in tokens):
        raise invalid(f"token ids must be in [0, {vocab})", "tokens")
    return web.json_response({"prompt": await decode(state.engine.tokenizer, tokens)})


async def tokenizer_info(request: web.Request) -> web.Response:
    """GET /tokenizer_info, as vLLM serves it: the tokenizer's class, named special tokens (text, or null) and chat
    template, and the context length (lm-evaluation-harness tokenizes through /tokenize once it finds this)."""
    state = request.app[STATE]
    state.auth.authenticate(request)
    return web.json_response({**state.engine.tokenizer.info(), "model_max_length": state.engine.max_model_len})


async def _checked(request: web.Request) -> tuple[GatewayState, _Fields]:
    state = request.app[STATE]
    state.auth.authenticate(request)
    fields = _Fields(parse_body(await request.read()))
    state.check_sent_model(fields)
    return state, fields
