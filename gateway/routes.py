"""HTTP handlers: /v1/chat/completions, /v1/completions, /v1/models, /v1/cache/stats, /health, /ping, /version,
/metrics, /openapi.json, and the chat page at /."""
from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from engine.messages import CacheDirectives
from gateway import __version__
from gateway.auth import Tenant
from gateway.cache_control import chat_directives, directives
from gateway.cache_stats import CACHE_STATS
from gateway.embeddings import POOLING
from gateway.errors import APIError, engine_down, invalid
from gateway.fingerprint import system_fingerprint
from gateway.formats import ChatFormat, CompletionFormat
from gateway.generate import Choice, best_choices, usage
from gateway.jsonbody import parse_body
from gateway.openapi import build_openapi
from gateway.protocol import GenerationRequest, parse_chat, parse_completion
from gateway.reasoning import answer_starts_thinking
from gateway.render import encode_prompts, render_chat, with_bos
from gateway.runner import RequestRun, sampling_params, with_calls_beside_format
from gateway.state import STATE, GatewayState
from gateway.streaming import stream_response
from gateway.tool_prompt import TOOL_TEMPLATE

log = logging.getLogger("gateway")
STATIC_DIR = Path(__file__).parent / "static"

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    tenant = state.auth.authenticate(request)
    req = parse_chat(await read_json(request), state.settings.gateway, state.sampling_defaults)
    state.check_model(req.model)
    tool_template = request.app[TOOL_TEMPLATE]
    req = with_calls_beside_format(req, tool_template.parser)
    with state.admission.admit(tenant, req.n):
        tools = tool_template.shown(req.tools)
        tokenizer = state.engine.tokenizer
        rendered = await render_chat(tokenizer, req.messages, tools, tool_template, req.add_generation_prompt,
                                     req.continue_final_message, req.template_variables)
        prompt = state.truncated(with_bos(tokenizer, rendered, req.add_special_tokens), req.truncate_prompt_tokens)
        cache = await chat_directives(tokenizer, req.messages, req.breakpoints, rendered, tools, tool_template,
                                      tenant.max_pinned_blocks, req.template_variables,
                                      len(prompt) - len(rendered))
        fmt = ChatFormat(_new_id("chatcmpl-"), state.model_name, state.engine.tokenizer,
                         fingerprint=_fingerprint(state), tools=req.tools, tool_call_parser=tool_template.parser,
                         token_ids=req.return_token_ids, tokens_as_ids=req.return_tokens_as_token_ids,
                         prompt_logprobs=req.prompt_logprobs, echo=req.echo,
                         thinking=answer_starts_thinking(tokenizer, req) if state.splits_thinking else None,
                         echo_continued=req.continue_final_message)
        return await _generate(request, state, tenant, req, [prompt], fmt, "messages", None, cache)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    tenant = state.auth.authenticate(request)
    req = parse_completion(await read_json(request), state.settings.gateway, state.sampling_defaults)
    state.check_model(req.model)
    with state.admission.admit(tenant, req.best_of * len(req.prompts)):
        tokenizer = state.engine.tokenizer
        whole = await encode_prompts(tokenizer, req.prompts, "prompt", req.add_special_tokens)
        prompts = [state.truncated(p, req.truncate_prompt_tokens, generates=req.max_tokens != 0) for p in whole]
        # echo: the prompt as sent, or the text of what was served of a cut one
        echoed = [sent if len(cut) == len(ids) else cut for sent, ids, cut in zip(req.prompts, whole, prompts)]
        fmt = CompletionFormat(_new_id("cmpl-"), state.model_name, tokenizer,
                               [p if isinstance(p, str) else tokenizer.decode(p) for p in echoed]
                               if req.echo else None, fingerprint=_fingerprint(state),
                               token_ids=req.return_token_ids, tokens_as_ids=req.return_tokens_as_token_ids,
                               prompt_logprobs=req.prompt_logprobs, echo_logprobs=req.logprobs is not None)
        return await _generate(request, state, tenant, req, prompts, fmt, "prompt",
                               COMPLETIONS_DEFAULT_MAX_TOKENS,
                               directives(list(req.breakpoints), tenant.max_pinned_blocks))


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.auth.authenticate(request)
    return web.json_response({"object": "list", "data": [_model_card(state)]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{model_id} (client.models.retrieve); the id may hold slashes ("org/name")."""
    state = request.app[STATE]
    state.auth.authenticate(request)
    state.check_model(request.match_info["model_id"])
    return web.json_response(_model_card(state))


def _model_card(state: GatewayState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "prefixgate",
            "max_model_len": state.engine.max_model_len,
            "sampling_defaults": state.sampling_defaults,  # what a request that leaves them out gets
            "embeddings": POOLING}  # how POST /v1/embeddings pools


async def cache_stats(request: web.Request) -> web.Response:
    """GET /v1/cache/stats: the caller's hit rate and the pool's occupancy (gateway/cache_stats.py)."""
    tenant = request.app[STATE].auth.authenticate(request)
    return web.json_response(request.app[CACHE_STATS].body(tenant.name))


async def chat_page(request: web.Request) -> web.FileResponse:
    """GET /: the chat page (gateway/static/), served as it is: no build step, no CDN."""
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def static_file(request: web.Request) -> web.FileResponse:
    """GET /static/{name}: the chat page's files (one flat folder). aiohttp's own static route answers a missing
    file with an empty 404 as its response starts, past the error middleware; this one is a JSON 404."""
    name = request.match_info["name"]
    path = STATIC_DIR / name
    if name.startswith(".") or not path.is_file():
        raise APIError(404, f"the chat page has no file {name[:100]!r}", code="not_found")
    return web.FileResponse(path)


async def health(request: web.Request) -> web.Response:
    if not request.app[STATE].engine.is_alive():
        raise engine_down("the engine is not running", "engine_dead")
    return web.json_response({"status": "ok", **request.app[STATE].engine.health_details()})


async def ping(request: web.Request) -> web.Response:
    """vLLM's (and SageMaker's) liveness probe: /health's answer."""
    return await health(request)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.auth.check_metrics_key(request)
    body, content_type = state.metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def openapi(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(build_openapi(state.model_name, state.engine.tokenizer.vocab_size,
                                           state.settings.gateway))


async def read_json(request: web.Request) -> Any:
    return parse_body(await request.read())  # over max_body_bytes: aiohttp raises 413, errors.py renders it


async def _generate(request: web.Request, state: GatewayState, tenant: Tenant, req: GenerationRequest,
                    prompts: list[list[int]], fmt: ChatFormat, prompt_param: str,
                    default_max_tokens: int | None, cache: CacheDirectives | None = None) -> web.StreamResponse:
    """`cache`: the breakpoints to pin, the same for every prompt."""
    choices = []
    samples = getattr(req, "best_of", req.n)
    for prompt_index, prompt in enumerate(prompts):
        max_tokens = state.check_lengths(len(prompt), req.max_tokens, prompt_param, default_max_tokens,
                                         req.max_tokens_param)
        if req.min_tokens > max_tokens:
            raise invalid(f"min_tokens ({req.min_tokens}) must be <= {req.max_tokens_param} ({max_tokens})",
                          "min_tokens")
        for i in range(samples):
            params = sampling_params(req, max_tokens, i, rank_by_logprob=samples > req.n)
            choices.append(Choice(len(choices), prompt_index, f"{fmt.response_id}-{len(choices)}", prompt, params,
                                  cache, stream=req.stream))
    run = RequestRun(state, tenant, req.cache_salt, choices, prompt_param)
    if req.stream:
        resp = await run.streamed(lambda outputs: stream_response(
            request, fmt, choices, outputs, req.include_usage, state.settings.gateway.stream_write_timeout_s,
            req.continuous_usage))
        _log_done(fmt.response_id, tenant, choices)
        return resp
    await run.to_end()
    for choice in choices:
        fmt.count_reasoning_tokens(choice)
    _log_done(fmt.response_id, tenant, choices)
    returned = best_choices(choices, req.n, req.logprobs is not None) if samples > req.n else choices
    return web.json_response(fmt.response(returned, usage(choices)))  # usage counts every sample generated


def _fingerprint(state: GatewayState) -> str:
    return system_fingerprint(state.settings.engine, state.model_name)


def _log_done(response_id: str, tenant: Tenant, choices: list[Choice]) -> None:
    u = usage(choices)
    log.info("%s done: tenant=%s choices=%d prompt_tokens=%d cached_tokens=%d completion_tokens=%d finish=%s",
             response_id, tenant.name, len(choices), u["prompt_tokens"],
             u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"],
             ",".join(sorted({str(c.finish_reason) for c in choices})))


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex
