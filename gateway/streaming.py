"""Server-sent events in OpenAI's chunk format, ending in `data: [DONE]`."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from engine.outputs import RequestOutput
from gateway.errors import APIError
from gateway.formats import ChatFormat
from gateway.generate import Choice, check_output, usage

log = logging.getLogger("gateway")

# (charset: a client reading text by HTTP's default for text types would decode the events as ISO-8859-1)
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


def encode_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def stream_response(request: web.Request, fmt: ChatFormat, choices: list[Choice],
                          outputs: AsyncIterator[tuple[Choice, RequestOutput]],
                          include_usage: bool, write_timeout_s: float,
                          continuous_usage: bool = False) -> web.StreamResponse:
    """Headers go out with the first engine output, so a failure before it is a plain error response.
    A failure after it is one `data: {"error": ...}` event, then `data: [DONE]` (as vLLM ends it, so a
    client's SSE reader closes cleanly after raising the error). A client that stops
    reading for write_timeout_s is dropped, so it cannot hold its admission slot and output forever.
    `continuous_usage`: every chunk carries its choice's usage so far (vLLM's continuous_usage_stats)."""
    resp: TimedStream | None = None

    def so_far(chunk: dict[str, Any], choice: Choice) -> dict[str, Any]:
        return {**chunk, "usage": usage([choice])} if continuous_usage else chunk

    try:
        async for choice, out in outputs:
            check_output(out)
            if resp is None:
                resp = await _start(request, fmt, choices, write_timeout_s, so_far)
            choice.add(out)
            if (chunk := fmt.delta_chunk(choice, out)) is not None:
                await resp.write(encode_event(so_far(chunk, choice)))
            if out.finished:
                await resp.write(encode_event(so_far(fmt.finish_chunk(choice), choice)))
        if resp is None:
            resp = await _start(request, fmt, choices, write_timeout_s, so_far)
        if include_usage:
            await resp.write(encode_event(fmt.chunk([], usage(choices))))
        await resp.write(b"data: [DONE]\n\n")
    except Exception as exc:
        return await end_on_error(request, resp, exc, lambda err: [encode_event(err.body()), b"data: [DONE]\n\n"],
                                  write_timeout_s)
    return await end(resp)


class TimedStream:
    """A prepared SSE response whose writes give up after a timeout (a client that stopped reading)."""

    def __init__(self, response: web.StreamResponse, timeout_s: float) -> None:
        self.response = response
        self.timeout_s = timeout_s

    async def write(self, data: bytes) -> None:
        async with asyncio.timeout(self.timeout_s):
            await self.response.write(data)


async def end(resp: TimedStream) -> web.StreamResponse:
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        await resp.response.write_eof()
    return resp.response


async def end_on_error(request: web.Request, resp: TimedStream | None, exc: Exception,
                       error_events: Callable[[APIError], list[bytes]], timeout_s: float) -> web.StreamResponse:
    """How a stream ends on `exc`: a client gone, or one that read nothing for the write timeout (dropped, its
    connection closed: it holds no admission slot and no output), is left; any other failure before the headers
    is raised (a plain error response), after them written as the stream's error_events (an unexpected one as a
    500 internal_error) and the stream ended."""
    if isinstance(exc, ConnectionResetError):
        log.info("client disconnected mid-stream")
        return resp.response if resp else web.StreamResponse()
    if isinstance(exc, TimeoutError):
        log.info("client read nothing for %.0fs; dropping its stream", timeout_s)
        if request.transport is not None:
            request.transport.close()
        return resp.response if resp else web.StreamResponse()
    if resp is None:
        raise exc
    err = exc if isinstance(exc, APIError) else APIError(500, "internal server error", code="internal_error")
    if not isinstance(exc, APIError):
        log.exception("error while streaming")
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        for event in error_events(err):
            await resp.write(event)
    return await end(resp)


async def _start(request: web.Request, fmt: ChatFormat, choices: list[Choice], write_timeout_s: float,
                 so_far: Callable[[dict[str, Any], Choice], dict[str, Any]]) -> TimedStream:
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await response.prepare(request)
    resp = TimedStream(response, write_timeout_s)
    for first in fmt.first_chunks(choices):
        await resp.write(encode_event(so_far(first, choices[first["choices"][0]["index"]])))
    return resp

