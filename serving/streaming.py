"""Server-sent events for ``stream: true`` on chat and text completions, in OpenAI's chunk shapes.

The engine's worker thread hands text deltas to an asyncio queue as it decodes; each becomes one
``data: {...}`` event. A reply that may hold tool calls is held back until it ends, then sent as content and
tool-call deltas (each call whole, with its index, id and name, as OpenAI's first delta of a call carries them),
because a half-generated ``<tool_call>`` block cannot be told apart from text before it closes. The last
chunk of each choice carries its ``finish_reason``; with ``stream_options.include_usage`` one more chunk
with empty choices carries the usage; ``data: [DONE]`` ends the stream. A client that disconnects cancels
its generation: its rows stop at the next decoding step and its batch slot is freed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from overstory.serving.engine import GenerationResult, PendingGeneration

_FINISHED = object()


def _event(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _Stream:
    """Bridges the worker thread's deltas and the job's end into the event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def on_delta(self, index: int, text: str) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, text))

    def on_done(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, _FINISHED)

    async def deltas(self) -> AsyncIterator[tuple[int, str]]:
        while (item := await self.queue.get()) is not _FINISHED:
            yield item


async def stream_generation(start: Callable[..., PendingGeneration], options: dict[str, Any],
                            chunk: Callable[[int, dict[str, Any] | None, str | None], dict[str, Any]],
                            finish: Callable[[GenerationResult], list[tuple[int, dict[str, Any], str]]],
                            include_usage: bool, record: Callable[[GenerationResult], None],
                            hold_back: bool = False) -> StreamingResponse:
    """Start a generation (``start(**options, on_delta=...)``, which may raise the engine's 4xx errors before
    any byte is sent) and stream it. ``chunk(index, delta, finish_reason)`` builds one event's payload,
    ``finish(result)`` the last deltas of every choice as (index, delta, finish_reason)."""
    stream = _Stream()
    pending = await run_in_threadpool(start, **options, on_delta=None if hold_back else stream.on_delta)
    pending.job.add_done_callback(stream.on_done)

    async def events() -> AsyncIterator[str]:
        finished = False
        try:
            async for index, text in stream.deltas():
                yield _event(chunk(index, {"content": text}, None))
            result = pending.result()  # the job has finished: this does not block
            for index, delta, reason in finish(result):
                yield _event(chunk(index, delta, reason))
            record(result)
            if include_usage:
                usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                         "total_tokens": result.prompt_tokens + result.completion_tokens}
                yield _event({**chunk(0, None, None), "choices": [], "usage": usage})
            finished = True
            yield _event("[DONE]")
        except Exception as exc:  # the status line has gone out: report the failure in the stream, as vLLM does
            finished = True
            yield _event({"error": {"message": f"generation failed ({exc.__class__.__name__})",
                                    "type": "server_error", "param": None, "code": 500}})
        finally:
            if not finished:  # the client went away mid-stream: stop generating for it
                pending.cancel()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def chat_chunk_builder(model: str) -> Callable[[int, dict[str, Any] | None, str | None], dict[str, Any]]:
    """Chunks of one chat completion stream: one id and creation time, the role on each choice's first delta."""
    ident, created, started = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), set()

    def chunk(index: int, delta: dict[str, Any] | None, finish_reason: str | None) -> dict[str, Any]:
        if delta is not None and index not in started:
            started.add(index)
            delta = {"role": "assistant", **delta}
        choices = [] if delta is None else [{"index": index, "delta": delta, "logprobs": None,
                                             "finish_reason": finish_reason}]
        return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices}

    return chunk


def completion_chunk_builder(model: str) -> Callable[[int, dict[str, Any] | None, str | None], dict[str, Any]]:
    """Chunks of one text completion stream (``text`` instead of a delta)."""
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(index: int, delta: dict[str, Any] | None, finish_reason: str | None) -> dict[str, Any]:
        choices = [] if delta is None else [{"index": index, "text": delta.get("content", ""), "logprobs": None,
                                             "finish_reason": finish_reason}]
        return {"id": ident, "object": "text_completion", "created": created, "model": model, "choices": choices}

    return chunk
