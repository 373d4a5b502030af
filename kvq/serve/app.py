"""The HTTP app: OpenAI-compatible routes over an `AsyncEngine`.

GET /health, GET /version, GET /metrics (Prometheus text), GET /v1/models (with vLLM's `root`), POST
/v1/completions and /v1/chat/completions (`stream: true` as server-sent events ending in `data: [DONE]`).
A bad request gets 400 (404 for another model name, 413 for a body too large, 429 when the queue is full,
401 without the key) and an OpenAI error body naming the problem; a request the engine stopped (a failed
KV page check, its own output handling failed) gets 500 with the engine's message, or, when streaming,
its last chunk with finish reason "error" and an error event after the text sent so far; one still
running when the shutdown timeout passes, or when the engine thread has stopped, gets 503 (or an error
event). Every error body, 5xx included, is OpenAI's JSON. A client that goes away, streaming or not,
aborts its request. Imports fastapi, prometheus_client and kvq.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvq import __version__ as kvq_version
from kvq.errors import KvqError
from kvq.runtime.outputs import RequestOutput
from kvq.runtime.sampling import SamplingParams
from kvq.serve.access import AccessMiddleware, ServeState
from kvq.serve.api_errors import ApiError, error_body
from kvq.serve.async_engine import AsyncEngine, ServerShuttingDown
from kvq.serve.choices import Choices, ClientGone, until_disconnected
from kvq.serve.encoder import PromptEncoder
from kvq.serve.limits import check_queue, max_tokens_for
from kvq.serve.metrics import ServeMetrics
from kvq.serve.protocol import ChatRequest, CompletionRequest, check_model
from kvq.serve.responses import PromptLogprobs, Reply, usage
from kvq.serve.server_config import ServerConfig

log = logging.getLogger("kvq.serve")


@dataclass
class Served:
    """What the routes share: the engine, the server's tokenizer, settings, metrics and drain state."""

    engine: AsyncEngine
    encoder: PromptEncoder
    model_name: str
    config: ServerConfig
    metrics: ServeMetrics
    state: ServeState


def make_app(served: Served) -> AccessMiddleware:
    app = FastAPI(title="kvq serve")
    served.metrics.bind(
        served.engine.engine, lambda: served.engine.num_waiting, lambda: served.engine.num_running
    )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        return JSONResponse(error_body(problems), status_code=400)

    @app.exception_handler(KvqError)
    async def _refused(request: Request, exc: KvqError) -> JSONResponse:
        code = 404 if "is not served here" in str(exc) else 400
        return JSONResponse(error_body(str(exc), code), status_code=code)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status == 429:
            served.metrics.admission_rejections.inc()
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """A body that is no JSON, an unknown route or method: OpenAI's shape, not FastAPI's `detail`."""
        message = f"{exc.detail} ({request.method} {request.url.path})"
        return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s failed", request.url.path, exc_info=exc)
        return JSONResponse(
            error_body(f"the server failed: {type(exc).__name__}: {exc}", 500), status_code=500
        )

    @app.get("/health", response_model=None)
    async def health() -> dict | JSONResponse:
        dead = served.engine.dead_reason
        if dead is not None:
            return JSONResponse(error_body(f"the engine stopped: {dead}", 503), status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict:
        return {"version": kvq_version}  # as vLLM and SGLang answer it

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(served.metrics.registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {
            "id": served.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvq",
            "root": str(served.engine.engine.ckpt.root),  # vLLM's: the checkpoint served (kvq eval --server)
            "max_model_len": served.engine.engine.max_model_len,
        }
        return {"object": "list", "data": [entry]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model, served.model_name)
        body.warn_ignored("/v1/completions")
        encoded = [await served.encoder.encode(p, bool(body.add_special_tokens)) for p in body.prompts]
        encoded = [
            (body.truncated(ids), text if body.truncate_prompt_tokens is None else None)
            for ids, text in encoded
        ]
        max_len = served.engine.engine.max_model_len
        num_prompt_logprobs = body.num_prompt_logprobs
        echoes: list[str] = []
        params: list[tuple[list[int], SamplingParams]] = []
        for ids, text in encoded:
            max_tokens = max_tokens_for(len(ids), body.max_tokens, 16, max_len, served.config, "prompt", 0)
            echo = (text if text is not None else await served.encoder.decode(ids)) if body.echo else ""
            for p in body.sampling_params(max_tokens, body.logprobs, num_prompt_logprobs):
                params.append((ids, p))
                echoes.append(echo)
        prompt = PromptLogprobs(
            bool(body.echo) and body.logprobs is not None, body.prompt_logprobs is not None
        )
        reply = Reply(
            f"cmpl-{uuid.uuid4().hex}", served.model_name, body.include_usage, body.continuous_usage, prompt
        )
        prompt_lens = [len(ids) for ids, _ in params]
        choices = await _start(served, request, params)
        if body.stream:

            async def events() -> AsyncIterator[dict]:
                seen: set[int] = set()
                async for index, out in choices.merged():
                    chunk_usage = usage([prompt_lens[index]], [out])
                    yield reply.completion_chunk(
                        index, out, "" if index in seen else echoes[index], chunk_usage
                    )
                    seen.add(index)
                    if out.finish_reason == "error":
                        yield _stopped(out)
                if body.include_usage:
                    yield reply.usage_chunk(
                        "text_completion", usage(_per_prompt(prompt_lens, body), choices.lasts)
                    )

            return _sse(events(), choices)
        finals = await _answer(request, choices)
        return _final(finals, reply.completion(finals, echoes, usage(_per_prompt(prompt_lens, body), finals)))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Response:
        check_model(body.model, served.model_name)
        body.warn_ignored("/v1/chat/completions")
        messages = [m.as_template_message() for m in body.messages]
        ids = body.truncated(
            await served.encoder.encode_messages(
                messages, bool(body.add_generation_prompt), body.chat_template_kwargs
            )
        )
        max_tokens = max_tokens_for(
            len(ids),
            body.requested_max_tokens,
            served.config.max_tokens,
            served.engine.engine.max_model_len,
            served.config,
            "messages",
        )
        params = [(ids, p) for p in body.sampling_params(max_tokens, body.num_logprobs, body.prompt_logprobs)]
        reply = Reply(
            f"chatcmpl-{uuid.uuid4().hex}", served.model_name, body.include_usage, body.continuous_usage
        )
        choices = await _start(served, request, params)
        if body.stream:

            async def events() -> AsyncIterator[dict]:
                for index in range(len(params)):
                    yield reply.chat_chunk(
                        index, {"role": "assistant", "content": ""}, None, usage([len(ids)], [])
                    )
                async for index, out in choices.merged():
                    delta = {"content": out.delta} if out.delta else {}
                    yield reply.chat_chunk(index, delta, out, usage([len(ids)], [out]))
                    if out.finish_reason == "error":
                        yield _stopped(out)
                if body.include_usage:
                    yield reply.usage_chunk("chat.completion.chunk", usage([len(ids)], choices.lasts))

            return _sse(events(), choices)
        finals = await _answer(request, choices)
        return _final(finals, reply.chat(finals, usage([len(ids)], finals), body.prompt_logprobs is not None))

    return AccessMiddleware(app, served.config, served.state)


async def _start(served: Served, request: Request, params: list[tuple[list[int], SamplingParams]]) -> Choices:
    """Queue every choice (429 if the queue is full) and wait for their first outputs."""
    check_queue(served.engine.num_waiting, len(params), served.config)
    choices = Choices([served.engine.generate(ids, p) for ids, p in params])
    try:
        await until_disconnected(request, choices.start())
    except BaseException as e:
        await choices.close()
        if isinstance(e, ServerShuttingDown):
            raise ApiError(503, f"the request was stopped: {e}") from e
        if isinstance(e, RuntimeError):  # the engine failed this step's requests
            raise ApiError(500, str(e)) from e
        raise
    return choices


async def _answer(request: Request, choices: Choices) -> list[RequestOutput]:
    """The final outputs; a client that goes away first aborts every choice."""
    try:
        return await until_disconnected(request, choices.finals())
    except ServerShuttingDown as e:
        raise ApiError(503, f"the request was stopped: {e}") from e
    except RuntimeError as e:  # the engine failed this step's requests
        raise ApiError(500, str(e)) from e
    finally:
        await choices.close()


def _stopped(out: RequestOutput) -> dict:
    """The error body of a request the engine stopped (finish reason "error": a failed KV page check)."""
    return error_body(f"generation stopped: {out.error}", 500)


def _per_prompt(lens: list[int], body: CompletionRequest) -> list[int]:
    """Each prompt's length once (its n choices share it, as vLLM counts)."""
    return lens[:: body.num_choices]


def _final(finals: list[RequestOutput], body: dict) -> Response:
    stopped = [out for out in finals if out.finish_reason == "error"]
    if stopped:
        return JSONResponse(_stopped(stopped[0]), status_code=500)
    return JSONResponse(body)


def _sse(events: AsyncIterator[dict], choices: Choices) -> StreamingResponse:
    async def stream() -> AsyncIterator[str]:
        try:
            try:
                async for event in events:
                    yield f"data: {json.dumps(event)}\n\n"
            except ServerShuttingDown as e:
                yield f"data: {json.dumps(error_body(f'the request was stopped: {e}', 503))}\n\n"
            except RuntimeError as e:  # the engine failed
                yield f"data: {json.dumps(error_body(str(e), 500))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await choices.close()  # a client that went away aborts its requests

    return StreamingResponse(stream(), media_type="text/event-stream")
