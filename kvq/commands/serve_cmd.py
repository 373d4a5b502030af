"""`kvq serve [MODEL] [--config FILE]`: the runtime engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvq.commands.config_options import ConfigOption, model_dir, read_config, refuse_paper_deployment
from kvq.commands.engine_options import OptionalModelArgument, engine_options
from kvq.commands.field_options import GivenOptions, field_options
from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig
from kvq.serve.server_config import ServerConfig

if TYPE_CHECKING:
    import subprocess

    from kvq.serve.app import Served
    from kvq.serve.async_engine import AsyncEngine
    from kvq.serve.metrics import ServeMetrics
    from kvq.serve.shutdown import DrainingServer

ROLES = ("single", "prefill", "decode", "pd")


@field_options(ServerConfig, "server")
@engine_options()
def serve_command(
    model: OptionalModelArgument = None,
    config: ConfigOption = None,
    *,
    server: GivenOptions,
    engine: GivenOptions,
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
    _require_serve_extra()
    from kvq.runtime.pd_engine import PDEngine
    from kvq.serve.pd_roles import check_transport, run_decode_worker, run_torch_decode_worker

    file = read_config(config)
    refuse_paper_deployment(file, "serve")
    path = model_dir(model, file)
    engine_config = EngineConfig(model=str(path), **engine.over(file.engine if file else {}))
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
    server_config = ServerConfig(**server.over(file.server if file else {}))
    child = None
    if role == "pd":
        from kvq.serve.pd_roles import engine_flags, start_decode_worker

        child, pd_socket = start_decode_worker([str(decode_model or path), *engine_flags(engine_config)])
    _serve_http(path, engine_config, server_config, role, (pd_socket, pd_addr), child)


def _require_serve_extra() -> None:
    try:
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise KvqError(
            f"kvq serve needs fastapi and uvicorn ({e}); install them: pip install 'kvq[serve]'"
        ) from e


def _serve_http(
    path: Path,
    engine_config: EngineConfig,
    server: ServerConfig,
    role: str,
    pd_link: tuple[str | None, str | None],
    child: subprocess.Popen | None,
) -> None:
    """The HTTP server in front of an engine (role single) or of the prefill side of a P/D split, until
    SIGTERM or the engine's death (then exit status 1); `child`, a decode worker, is stopped with it."""
    import uvicorn

    from kvq.serve.access import ServeState
    from kvq.serve.app import Served, make_app
    from kvq.serve.encoder import PromptEncoder
    from kvq.serve.metrics import ServeMetrics
    from kvq.serve.pd_roles import stop_child
    from kvq.serve.shutdown import DrainingServer

    servers: list[DrainingServer] = []  # the one below, once made: the engine's death stops it
    try:
        metrics = ServeMetrics()
        engine = _async_engine(engine_config, role, pd_link, metrics, servers)
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


def _async_engine(
    engine_config: EngineConfig,
    role: str,
    pd_link: tuple[str | None, str | None],
    metrics: ServeMetrics,
    servers: list[DrainingServer],
) -> AsyncEngine:
    """The engine thread HTTP requests go to: an `Engine`, or the prefill front of a P/D split."""
    from kvq.runtime.distributed.worker import follow_under_launcher
    from kvq.runtime.engine import Engine
    from kvq.serve.async_engine import AsyncEngine
    from kvq.serve.pd_roles import PrefillFront

    def on_death() -> None:
        for server_ in servers:
            server_.drain_now()

    if role == "single":
        follow_under_launcher(engine_config)  # under torchrun, ranks past 0 end here
    front = Engine(engine_config) if role == "single" else PrefillFront(engine_config, *pd_link)
    return AsyncEngine(front, metrics, on_death=on_death)


def _banner(served: Served) -> str:
    c = served.config
    where = (
        "this machine only (loopback); --host 0.0.0.0 listens on every interface"
        if c.is_loopback
        else "reachable from the network"
    )
    key = "an API key is required" if c.api_key else "no API key: anyone who can connect may use it"
    return f"kvq serve: {served.model_name} on http://{c.host}:{c.port}, {where}; {key}"
