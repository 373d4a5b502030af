"""`kvq serve [MODEL] [--config FILE]`: the runtime engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvq.commands.config_options import (
    ConfigOption,
    model_dir,
    read_config,
    refuse_paper_deployment,
    settings,
)
from kvq.commands.engine_options import (
    ENGINE_OPTION_NAMES,
    DtypeOption,
    EnforceEagerOption,
    Int4ComputeOption,
    KvCacheDtypeOption,
    KvIntegrityOption,
    KvMemoryOption,
    LmHeadWeightsOption,
    MaxModelLenOption,
    MaxNumSeqsOption,
    OptionalModelArgument,
    PageSizeOption,
    RequireKvScalesOption,
    ThreadsOption,
    TpOption,
)
from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig
from kvq.serve.server_config import ServerConfig

if TYPE_CHECKING:
    from kvq.serve.app import Served

SERVER_OPTION_NAMES = (
    "host", "port", "served_model_name", "api_key", "metrics_need_key", "max_waiting", "max_tokens",
    "max_prompt_tokens", "max_completion_tokens", "max_body_bytes", "shutdown_timeout", "log_level",
)  # fmt: skip
ROLES = ("single", "prefill", "decode", "pd")


def serve_command(
    ctx: typer.Context,
    model: OptionalModelArgument = None,
    config: ConfigOption = None,
    host: Annotated[
        str,
        typer.Option(
            help="Address to listen on: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)."
        ),
    ] = ServerConfig.host,
    port: Annotated[int, typer.Option(help="TCP port (0: any free one).")] = ServerConfig.port,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model name clients send (default: the directory name).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="KVQ_API_KEY",
            help="Every /v1/* request must send 'Authorization: Bearer KEY' (else 401). /health stays open.",
        ),
    ] = None,
    metrics_need_key: Annotated[
        bool, typer.Option("--metrics-need-key", help="/metrics needs the API key too.")
    ] = False,
    max_waiting: Annotated[
        int | None,
        typer.Option(
            help="Most requests accepted but not started; more get 429 with Retry-After (default: no bound)."
        ),
    ] = None,
    max_tokens: Annotated[
        int, typer.Option(help="max_tokens of a chat request that sets none (completions: 16, as OpenAI).")
    ] = ServerConfig.max_tokens,
    max_prompt_tokens: Annotated[
        int | None, typer.Option(help="Most prompt tokens per request (default: the context); more get 400.")
    ] = None,
    max_completion_tokens: Annotated[
        int | None, typer.Option(help="Most max_tokens per request (default: the context); more get 400.")
    ] = None,
    max_body_bytes: Annotated[
        str, typer.Option(help="Largest request body, e.g. 4MiB; larger ones get 413.")
    ] = str(ServerConfig.max_body_bytes),
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds running requests get to finish after SIGTERM; the rest end with an error."
        ),
    ] = ServerConfig.shutdown_timeout,
    log_level: Annotated[
        str, typer.Option(help="critical, error, warning, info or debug.")
    ] = ServerConfig.log_level,
    max_num_seqs: MaxNumSeqsOption = EngineConfig.max_num_seqs,
    max_model_len: MaxModelLenOption = None,
    kv_cache_dtype: KvCacheDtypeOption = EngineConfig.kv_cache_dtype,
    page_size: PageSizeOption = EngineConfig.page_size,
    kv_memory: KvMemoryOption = None,
    require_kv_scales: RequireKvScalesOption = False,
    dtype: DtypeOption = EngineConfig.dtype,
    threads: ThreadsOption = None,
    tp: TpOption = EngineConfig.tp,
    lm_head_weights: LmHeadWeightsOption = EngineConfig.lm_head_weights,
    int4_compute: Int4ComputeOption = EngineConfig.int4_compute,
    enforce_eager: EnforceEagerOption = EngineConfig.enforce_eager,
    kv_integrity: KvIntegrityOption = EngineConfig.kv_integrity,
    role: Annotated[
        str,
        typer.Option(
            help="single (one engine does all); prefill (this HTTP server prefills and hands each "
            "prompt's KV pages to the decode worker at --pd-socket); decode (no HTTP: decode the "
            "requests whose pages a prefill worker sends, on --pd-socket); pd (both in one command: a "
            "decode worker on --decode-model in a child process, prefill here)."
        ),
    ] = "single",
    pd_socket: Annotated[
        str | None, typer.Option(help="Unix socket of the decode worker (roles prefill and decode).")
    ] = None,
    decode_model: Annotated[
        Path | None,
        typer.Option(help="--role pd: the decode worker's checkpoint (e.g. INT4; default: MODEL)."),
    ] = None,
    pd_transport: Annotated[
        str,
        typer.Option(
            help="Roles prefill and decode: shm (one host: a Unix socket at --pd-socket, pages through "
            "shared memory) or torch (between hosts: torch.distributed point-to-point over gloo, the decode "
            "worker listening at --pd-addr)."
        ),
    ] = "shm",
    pd_addr: Annotated[
        str | None,
        typer.Option(
            help="--pd-transport torch: HOST:PORT the decode worker listens on (its own TCP store) and the "
            "prefill worker connects to."
        ),
    ] = None,
) -> None:
    """Serve MODEL over HTTP: /v1/completions and /v1/chat/completions (OpenAI's API, `stream: true` as
    server-sent events), /v1/models, /metrics (Prometheus), /health.

    Requests from all clients are batched together (continuous batching over the paged KV pool); a
    client that disconnects frees its pages. Listens on 127.0.0.1 unless --host says otherwise. SIGTERM
    drains: running requests get --shutdown-timeout seconds, then the process exits 0. Should the engine
    itself stop, /health answers 503 and the process exits 1 (for a supervisor to restart it). Needs the
    serve extra (fastapi, uvicorn, prometheus-client).
    """
    try:
        import uvicorn
    except ImportError as e:
        raise KvqError(
            f"kvq serve needs fastapi and uvicorn ({e}); install them: pip install 'kvq[serve]'"
        ) from e
    from kvq.runtime.engine import Engine
    from kvq.runtime.pd_engine import PDEngine
    from kvq.serve.access import ServeState
    from kvq.serve.app import Served, make_app
    from kvq.serve.async_engine import AsyncEngine
    from kvq.serve.encoder import PromptEncoder
    from kvq.serve.metrics import ServeMetrics
    from kvq.serve.pd_roles import (
        PrefillFront,
        check_transport,
        engine_flags,
        run_decode_worker,
        run_torch_decode_worker,
        start_decode_worker,
        stop_child,
    )
    from kvq.serve.shutdown import DrainingServer

    file = read_config(config)
    refuse_paper_deployment(file, "serve")
    path = model_dir(model, file)
    engine_config = EngineConfig(
        model=str(path), **settings(ctx, file.engine if file else {}, ENGINE_OPTION_NAMES)
    )
    if role not in ROLES:
        raise KvqError(f"--role is {role!r}; pick one of {', '.join(ROLES)}")
    check_transport(role, pd_transport, pd_socket, pd_addr)
    if pd_transport == "torch":
        pd_socket = None
    else:
        pd_addr = None
    if role == "decode" and pd_addr is not None:
        run_torch_decode_worker(PDEngine(engine_config), pd_addr)
        return
    if role == "decode":
        run_decode_worker(PDEngine(engine_config), str(pd_socket))
        return
    server = ServerConfig(**settings(ctx, file.server if file else {}, SERVER_OPTION_NAMES))
    child = None
    if role == "pd":
        child, pd_socket = start_decode_worker([str(decode_model or path), *engine_flags(engine_config)])
    servers: list[DrainingServer] = []  # the one below, once made: the engine's death stops it

    def on_death() -> None:
        for server_ in servers:
            server_.drain_now()

    try:
        front = Engine(engine_config) if role == "single" else PrefillFront(engine_config, pd_socket, pd_addr)
        metrics = ServeMetrics()
        engine = AsyncEngine(front, metrics, on_death=on_death)
    except BaseException:
        stop_child(child)
        raise
    state = ServeState()
    served = Served(
        engine, PromptEncoder(path), server.served_model_name or path.resolve().name, server, metrics, state
    )
    uv_config = uvicorn.Config(
        make_app(served), host=server.host, port=server.port, log_level=server.log_level, access_log=False
    )
    uv = DrainingServer(uv_config, engine, state, server.shutdown_timeout)
    servers.append(uv)
    print(_banner(served), file=sys.stderr, flush=True)
    try:
        uv.run()
    finally:
        engine.stop()
        served.encoder.close()
        stop_child(child)
    if engine.dead_reason is not None:
        print(f"kvq serve: exiting with status 1: the engine stopped ({engine.dead_reason})", file=sys.stderr)
        raise SystemExit(1)


def _banner(served: Served) -> str:
    c = served.config
    where = (
        "this machine only (loopback); --host 0.0.0.0 listens on every interface"
        if c.is_loopback
        else "reachable from the network"
    )
    key = "an API key is required" if c.api_key else "no API key: anyone who can connect may use it"
    return f"kvq serve: {served.model_name} on http://{c.host}:{c.port}, {where}; {key}"
