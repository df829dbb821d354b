"""`POST /v1/embeddings` for the served model: each input's vector is the final hidden state of its last token,
L2-normalized (last-token pooling, as decoder embedding models such as E5-Mistral and gte-Qwen pool). It goes
through the engine's prefill path like any prompt, so its blocks are cached: a document embedded for
retrieval is a cache hit when a chat then asks about it, and the last token is always computed, so a cached
prefix never changes a vector."""
from __future__ import annotations

import base64
import struct
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine.sampling_params import SamplingParams
from gateway.errors import invalid
from gateway.generate import Choice, prompt_tokens_details
from gateway.jsonbody import parse_body
from gateway.protocol import _Fields, parse_prompts, truncate_prompt_tokens
from gateway.render import encode_prompts
from gateway.runner import RequestRun
from gateway.state import STATE

POOLING = {"pooling": "last", "normalized": True}  # what /v1/models says of this endpoint
ENCODINGS = ("float", "base64")


@dataclass(slots=True)
class EmbeddingRequest:
    model: str | None
    inputs: list[str | list[int]]
    encoding_format: str
    cache_salt: str | None
    truncate_prompt_tokens: int | None  # vLLM's: embed each input's last k tokens (-1: as many as fit)
    add_special_tokens: bool  # the tokenizer's BOS before each text input (vLLM's default)


def parse_embedding(body: Any, max_inputs: int) -> EmbeddingRequest:
    fields = _Fields(body)
    model = fields.string("model", None) or None  # None: the served model
    if fields.body.get("dimensions") is not None:
        raise invalid("dimensions is not supported: this server's embeddings have the model's hidden size",
                      "dimensions")
    encoding = fields.string("encoding_format", "float")
    if encoding not in ENCODINGS:
        raise invalid(f"encoding_format must be one of {list(ENCODINGS)}", "encoding_format")
    fields.string("user", None)  # accepted, as OpenAI's API does; not used
    return EmbeddingRequest(model, parse_prompts(fields.body.get("input"), max_inputs, "input"), encoding,
                            fields.string("cache_salt", None), truncate_prompt_tokens(fields),
                            fields.boolean("add_special_tokens", True))


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """float: the numbers; base64: little-endian float32 bytes (what the openai SDK asks for and decodes)."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tenant = state.auth.authenticate(request)
    req = parse_embedding(parse_body(await request.read()), state.settings.gateway.max_prompts)
    state.check_model(req.model)
    with state.admission.admit(tenant, len(req.inputs)):
        prompts = [state.truncated(p, req.truncate_prompt_tokens, generates=False)
                   for p in await encode_prompts(state.engine.tokenizer, req.inputs, "input", req.add_special_tokens)]
        for prompt in prompts:
            state.check_prompt(len(prompt), "input", generates=False)
        response_id = f"embd-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=1, pooling="last")
        choices = [Choice(i, i, f"{response_id}-{i}", p, params, stream=False) for i, p in enumerate(prompts)]
        await RequestRun(state, tenant, req.cache_salt, choices, "input").to_end()
    tokens = sum(len(p) for p in prompts)
    return web.json_response({
        "object": "list", "model": state.model_name,
        "data": [{"object": "embedding", "index": i, "embedding": _encoded(c.embedding, req.encoding_format)}
                 for i, c in enumerate(choices)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                  "prompt_tokens_details": prompt_tokens_details(choices)},
    })
