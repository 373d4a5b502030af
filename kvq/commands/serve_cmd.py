"""`kvq serve MODEL`: the runtime engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

from typing import Annotated

import typer

from kvq.commands.engine_options import (
    DtypeOption,
    KvCacheDtypeOption,
    KvIntegrityOption,
    KvMemoryOption,
    LmHeadWeightsOption,
    ModelArgument,
    PageSizeOption,
    RequireKvScalesOption,
    ThreadsOption,
    TpOption,
)
from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig


def serve_command(
    model: ModelArgument,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model name clients send (default: the directory name).")
    ] = None,
    max_tokens: Annotated[
        int, typer.Option(help="max_tokens of a chat request that sets none (completions: 16, as OpenAI).")
    ] = 256,
    max_num_seqs: Annotated[
        int, typer.Option(help="Most requests decoded together; the rest wait for KV pages.")
    ] = EngineConfig.max_num_seqs,
    kv_cache_dtype: KvCacheDtypeOption = EngineConfig.kv_cache_dtype,
    page_size: PageSizeOption = EngineConfig.page_size,
    kv_memory: KvMemoryOption = None,
    require_kv_scales: RequireKvScalesOption = False,
    dtype: DtypeOption = EngineConfig.dtype,
    threads: ThreadsOption = None,
    tp: TpOption = EngineConfig.tp,
    lm_head_weights: LmHeadWeightsOption = EngineConfig.lm_head_weights,
    kv_integrity: KvIntegrityOption = EngineConfig.kv_integrity,
) -> None:
    """Serve MODEL over HTTP: /v1/completions and /v1/chat/completions (OpenAI's API, `stream: true` as
    server-sent events), /v1/models, /health.

    Requests from all clients are batched together (continuous batching over the paged KV pool); a
    client that disconnects mid-stream frees its pages. Needs the serve extra (fastapi, uvicorn).
    """
    try:
        import uvicorn
    except ImportError as e:
        raise KvqError(
            f"kvq serve needs fastapi and uvicorn ({e}); install them: pip install 'kvq[serve]'"
        ) from e
    from kvq.runtime.engine import Engine
    from kvq.serve.app import make_app
    from kvq.serve.async_engine import AsyncEngine

    config = EngineConfig(
        model=str(model),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        page_size=page_size,
        kv_memory=kv_memory,
        require_kv_scales=require_kv_scales,
        threads=threads,
        tp=tp,
        lm_head_weights=lm_head_weights,
        max_num_seqs=max_num_seqs,
        kv_integrity=kv_integrity,
    )
    engine = AsyncEngine(Engine(config))
    try:
        uvicorn.run(
            make_app(engine, served_model_name or model.resolve().name, max_tokens), host=host, port=port
        )
    finally:
        engine.stop()
