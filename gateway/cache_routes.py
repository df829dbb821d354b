"""A tenant's cache under its own control: `GET /v1/cache` lists the caller's pinned prefixes,
`POST /v1/cache/warm` computes and pins a prompt without generating anything, `DELETE /v1/cache` erases the
caller's cached blocks, in memory and on disk, pinned or not, and its stored responses. Each acts on the
caller's tenant only (the anonymous one without API keys)."""
from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from engine.messages import CacheBreakpoint, CacheErased, PinInfo
from engine.sampling_params import SamplingParams
from gateway.cache_control import (DEFAULT_TTL, TTLS, WHOLE_PROMPT, chat_breakpoints, chat_directives, directives,
                                   parse_ttl)
from gateway.errors import APIError, invalid
from gateway.generate import Choice, prompt_tokens_details
from gateway.jsonbody import parse_body
from gateway.protocol import _Fields, parse_prompts
from gateway.render import encode_prompts, render_body_chat, with_bos
from gateway.responses import RESPONSE_STORE
from gateway.runner import RequestRun, run_command
from gateway.state import STATE, GatewayState
from gateway.tool_prompt import TOOL_TEMPLATE

ERASE_RETRY_AFTER_S = 1


async def list_pins(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tenant = state.auth.authenticate(request)
    listed = await run_command(state.engine, state.engine.list_pins(tenant.name))
    return web.json_response({"object": "list", "data": [_pin(p) for p in listed.pins],
                              "pinned_blocks": listed.num_blocks,
                              "max_pinned_blocks": tenant.max_pinned_blocks})


async def erase(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tenant = state.auth.authenticate(request)
    # its conversations are its cache too; first, so that a database that cannot be written (a 503) leaves all as it was
    responses = await request.app[RESPONSE_STORE].aerase(tenant.name)
    erased: CacheErased = await run_command(state.engine, state.engine.erase_cache(tenant.name))
    if erased.disk_blocks_kept:  # asked for an erasure, the client must learn it is not complete
        raise APIError(503, f"{erased.disk_blocks_kept} block files of the cache could not be deleted from the disk "
                            "tier now (they are not served meanwhile); try again", code="cache_erase_incomplete",
                       headers={"Retry-After": str(ERASE_RETRY_AFTER_S)})
    return web.json_response({"object": "cache.deleted", "deleted": True, "blocks": erased.blocks,
                              "disk_blocks": erased.disk_blocks, "pins": erased.pins, "responses": responses})


async def warm(request: web.Request) -> web.Response:
    """Body: `messages` (with optional `tools`: the prefix a chat with them starts with) or `prompt`, an
    optional `cache_control` ({"type": "ephemeral", "ttl": "5m" | "1h"}, default 5m) and `cache_salt`."""
    state = request.app[STATE]
    tenant = state.auth.authenticate(request)
    fields = _Fields(parse_body(await request.read()))
    state.check_sent_model(fields)
    raw = fields.body.get("cache_control")
    ttl_s = TTLS[DEFAULT_TTL] if raw is None else parse_ttl(raw, "cache_control")
    with state.admission.admit(tenant, 1):
        prompt, param, marked = await _prompt(request, state, fields, tenant.max_pinned_blocks)
        state.check_lengths(len(prompt), 1, param)
        pins = [*marked, CacheBreakpoint(WHOLE_PROMPT, ttl_s)]
        choice = Choice(0, 0, f"warm-{uuid.uuid4().hex}", prompt, SamplingParams(max_tokens=1, pooling="none"),
                        directives(pins, tenant.max_pinned_blocks), stream=False)
        await RequestRun(state, tenant, fields.string("cache_salt", None), [choice], param).to_end()
    return web.json_response({"object": "cache.warm", "model": state.model_name,
                              "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt),
                                        "prompt_tokens_details": prompt_tokens_details([choice])}})


async def _prompt(request: web.Request, state: GatewayState, fields: _Fields,
                  max_pinned_blocks: int | None) -> tuple[list[int], str, list[CacheBreakpoint]]:
    """The tokens to warm: the chat rendered as a later request's prompt starts (no generation prompt), or
    the completion prompt; and the prefixes its messages' own cache_control marks, as a chat request pins them."""
    body = fields.body
    if (body.get("messages") is None) == (body.get("prompt") is None):
        raise invalid("send either messages (a chat prefix) or prompt", "messages")
    tokenizer = state.engine.tokenizer
    if body.get("prompt") is not None:
        prompts = parse_prompts(body["prompt"], 1)
        bos = fields.boolean("add_special_tokens", True)  # as /v1/completions encodes a prompt
        return (await encode_prompts(tokenizer, prompts, "prompt", bos))[0], "prompt", []
    template = request.app[TOOL_TEMPLATE]
    messages, template_tools, variables, rendered = await render_body_chat(
        tokenizer, body, state.settings.gateway.max_messages, template, add_generation_prompt=False)
    prompt = with_bos(tokenizer, rendered, fields.boolean("add_special_tokens", False))
    # (the body's own cache_control is the whole prompt's TTL here, not a breakpoint)
    marks = chat_breakpoints({**body, "cache_control": None})
    marked = await chat_directives(tokenizer, messages, tuple(marks), rendered, template_tools, template,
                                   max_pinned_blocks, variables, len(prompt) - len(rendered))
    return prompt, "messages", list(marked.breakpoints) if marked else []


def _pin(pin: PinInfo) -> dict[str, Any]:
    ttl = next((name for name, seconds in TTLS.items() if seconds == pin.ttl_s), f"{pin.ttl_s:g}s")
    return {"object": "cache.pin", "id": f"pin_{pin.pin_id[:32]}", "tokens": pin.num_tokens,
            "blocks": pin.num_blocks, "ttl": ttl, "created_at": int(pin.created_at),
            "expires_at": int(pin.expires_at), "hits": pin.hits}
