"""Server-sent events in OpenAI's chunk format, ending in `data: [DONE]`."""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from engine.outputs import RequestOutput
from gateway.errors import APIError
from gateway.formats import ChatFormat
from gateway.generate import Choice, check_output, usage

log = logging.getLogger("gateway")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def stream_response(request: web.Request, fmt: ChatFormat, choices: list[Choice],
                          outputs: AsyncIterator[tuple[Choice, RequestOutput]],
                          include_usage: bool) -> web.StreamResponse:
    """Headers go out with the first engine output, so a failure before it is a plain error response.
    A failure after it is one `data: {"error": ...}` event, then the stream ends."""
    resp: web.StreamResponse | None = None
    text_len = {c.index: 0 for c in choices}
    try:
        async for choice, out in outputs:
            check_output(out)
            if resp is None:
                resp = await _start(request, fmt, choices)
            offset = text_len[choice.index]
            choice.add(out)
            text_len[choice.index] += len(out.new_text)
            if (chunk := fmt.delta_chunk(choice, out, offset)) is not None:
                await resp.write(encode_event(chunk))
            if out.finished:
                await resp.write(encode_event(fmt.finish_chunk(choice)))
        if resp is None:
            resp = await _start(request, fmt, choices)
        if include_usage:
            await resp.write(encode_event(fmt.chunk([], usage(choices))))
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        log.info("client disconnected mid-stream")
        return resp or web.StreamResponse()
    except Exception as exc:
        if resp is None:
            raise
        err = exc if isinstance(exc, APIError) else APIError(500, "internal server error", code="internal_error")
        if not isinstance(exc, APIError):
            log.exception("error while streaming")
        with contextlib.suppress(ConnectionResetError):
            await resp.write(encode_event(err.body()))
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


async def _start(request: web.Request, fmt: ChatFormat, choices: list[Choice]) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await resp.prepare(request)
    if (first := fmt.first_chunk(choices)) is not None:
        await resp.write(encode_event(first))
    return resp

