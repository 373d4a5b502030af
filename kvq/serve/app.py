"""The HTTP app: OpenAI-compatible routes over an `AsyncEngine`.

GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with `stream: true`
as server-sent events ending in `data: [DONE]`). A bad request gets status 400 (404 for another model
name) and an OpenAI error body naming the problem; a request the engine stopped (a failed KV page check)
gets 500 with the engine's message, or, when streaming, an error event after the text sent so far.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from kvq.errors import KvqError
from kvq.runtime.engine import Engine, RequestOutput
from kvq.serve.async_engine import AsyncEngine
from kvq.serve.protocol import ChatRequest, CompletionRequest, Reply, check_model, error_body

Outputs = AsyncGenerator[RequestOutput, None]


def make_app(engine: AsyncEngine, model_name: str, default_max_tokens: int) -> FastAPI:
    app = FastAPI(title="kvq serve")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        return JSONResponse(error_body(problems), status_code=400)

    @app.exception_handler(KvqError)
    async def _refused(request: Request, exc: KvqError) -> JSONResponse:
        code = 404 if "is not served here" in str(exc) else 400
        return JSONResponse(error_body(str(exc), code=code), status_code=code)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvq",
            "max_model_len": engine.engine.max_model_len,
        }
        return {"object": "list", "data": [entry]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> JSONResponse | StreamingResponse:
        check_model(body.model, model_name)
        params = body.sampling_params(body.max_tokens)
        prompt = body.prompt

        def encode(e: Engine) -> list[int]:
            return e.encode(prompt) if isinstance(prompt, str) else list(prompt)

        reply = Reply(f"cmpl-{uuid.uuid4().hex}", model_name)
        outputs = engine.generate(encode, params)
        first = await _first(outputs)
        if body.stream:

            async def events() -> AsyncIterator[dict]:
                async for out in _with_first(first, outputs):
                    yield reply.completion_chunk(out)
                    if out.finish_reason == "error":
                        yield _stopped(out)

            return _sse(events(), outputs)
        final = await _last(first, outputs)
        return _final(final, reply.completion)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest) -> JSONResponse | StreamingResponse:
        check_model(body.model, model_name)
        params = body.sampling_params(body.chat_max_tokens(default_max_tokens))
        messages = [m.model_dump() for m in body.messages]
        reply = Reply(f"chatcmpl-{uuid.uuid4().hex}", model_name)
        outputs = engine.generate(lambda e: e.encode_messages(messages), params)
        first = await _first(outputs)
        if body.stream:

            async def events() -> AsyncIterator[dict]:
                yield reply.chat_chunk({"role": "assistant", "content": ""}, None)
                async for out in _with_first(first, outputs):
                    delta = {"content": out.delta} if out.delta else {}
                    yield reply.chat_chunk(delta, out.finish_reason)
                    if out.finish_reason == "error":
                        yield _stopped(out)

            return _sse(events(), outputs)
        final = await _last(first, outputs)
        return _final(final, reply.chat)

    return app


async def _first(outputs: Outputs) -> RequestOutput:
    """The first output: by then the engine has accepted the request (or raised `KvqError`: a 400)."""
    return await outputs.__anext__()


async def _with_first(
    first: RequestOutput, outputs: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    yield first
    if not first.finished:
        async for out in outputs:
            yield out


async def _last(first: RequestOutput, outputs: Outputs) -> RequestOutput:
    last = first
    while not last.finished:
        last = await outputs.__anext__()
    return last


def _stopped(out: RequestOutput) -> dict:
    """The error body of a request the engine stopped (finish reason "error": a failed KV page check)."""
    return error_body(f"generation stopped: {out.error}", kind="server_error", code=500)


def _final(out: RequestOutput, body: Callable[[RequestOutput], dict]) -> JSONResponse:
    if out.finish_reason == "error":
        return JSONResponse(_stopped(out), status_code=500)
    return JSONResponse(body(out))


def _sse(events: AsyncIterator[dict], outputs: Outputs) -> StreamingResponse:
    async def stream() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await outputs.aclose()  # a client that went away aborts its request

    return StreamingResponse(stream(), media_type="text/event-stream")
