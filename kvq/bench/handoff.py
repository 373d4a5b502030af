"""`kvq bench handoff`: what handing a prompt's KV pages from a prefill engine to a decode engine costs.

Two engines in one process (`kvq.runtime.pd_engine.PDEngine`): the embedded SmolLM2 (BF16 weights both
sides, GQA pages) or the glm_moe_dsa bench fixture of `kvq bench decode --model glm_moe_dsa` (FP8-block
prefill, INT4 decode, MLA latent + DSA index key pages in BF16). For each prompt length, fresh random
prompts (no prefix page shared); each stage of one handoff is timed on its own: export (gather the pages
to the host, digest each), send (a new shared-memory segment, the bytes copied in, the rest pickled over
a `multiprocessing` pipe: `kvq.serve.pd_link`, the transport `kvq serve --role prefill|decode` uses; with
`--transport torch` the message, pages inside, pickled over a loopback gloo link, `kvq.serve.pd_torch`),
receive (attach, copy out, unlink; torch: the message unpickled), verify (digests and tags), admit
(block manager + the copy into the decode pool). Per prompt token, median over repeats, next to the
prefill step's own time per token (the compute the handoff adds to). Both ends of the link are in this
process: the cost of the peer process being scheduled (and of a real network) is not in it.
Imports torch, typer, rich and kvq.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from multiprocessing import Pipe
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.table import Table

from kvq.bench.json_output import JsonOption, write_json
from kvq.commands.field_options import GivenOptions, field_options
from kvq.commands.render import console
from kvq.errors import KvqError
from kvq.runtime.config import option

STAGES = ("export", "send", "receive", "verify", "admit")
MODELS = ("smollm2", "glm_moe_dsa")


@dataclass(frozen=True)
class HandoffBenchConfig:
    """Every setting of the benchmark; a field made by `option` is also its --field-name."""

    model: str = option(
        "smollm2",
        "smollm2: the embedded SmolLM2, BF16 both sides (GQA pages); glm_moe_dsa: the MLA bench fixture, "
        "FP8-block prefill and INT4 decode (latent + index key pages).",
    )
    prompt_tokens: tuple[int, ...] = (128, 512, 2048)  # --prompt-tokens: comma-separated
    repeats: int = option(5, "Timed handoffs per length (median).")
    threads: int = option(2, "torch threads (pinned).")
    page_size: int = option(16, "Tokens per KV page.")
    transport: str = option(  # both ends in this process
        "shm",
        "shm (shared memory, one host) or torch (torch.distributed over gloo on loopback: what "
        "--pd-transport torch sends between hosts, without the network).",
    )


@dataclass
class HandoffBenchResult:
    config: dict
    prefill_model: str = ""
    decode_model: str = ""
    kv_bytes_per_token: int = 0
    # prompt length -> stage (and "total", "prefill step") -> microseconds per prompt token, median
    us_per_token: dict[int, dict[str, float]] = field(default_factory=dict)


def bench_paths(model: str) -> tuple[Path, Path, str]:
    """(prefill checkpoint, decode checkpoint, KV cache dtype) of `model`."""
    if model == "smollm2":
        from kvq.data.embedded_model import ensure_smollm2

        bf16 = ensure_smollm2().bf16
        return bf16, bf16, "auto"
    if model == "glm_moe_dsa":
        from kvq.bench.decode_mla import MlaBenchConfig, bench_models

        paths = bench_models(MlaBenchConfig())
        return paths["fp8-block"], paths["int4"], "bf16"  # FP8 latents would need one set of scales
    raise KvqError(f"--model is {model!r}; pick one of {', '.join(MODELS)}")


def run_handoff_bench(config: HandoffBenchConfig) -> HandoffBenchResult:
    from kvq.runtime.config import EngineConfig
    from kvq.runtime.pd_engine import PDEngine

    torch.set_num_threads(config.threads)
    prefill_path, decode_path, kv_dtype = bench_paths(config.model)
    longest = max(config.prompt_tokens)

    def engine(path: Path) -> PDEngine:
        return PDEngine(
            EngineConfig(
                model=str(path),
                threads=config.threads,
                kv_cache_dtype=kv_dtype,
                page_size=config.page_size,
                max_num_seqs=2,
                kv_memory=f"{2 * (longest + 8) * 64}KiB",  # two prompts at up to 64 KiB per token
                max_model_len=longest + 8,
                max_num_batched_tokens=longest + 8,
            )
        )

    prefill, decode = engine(prefill_path), engine(decode_path)
    pool = prefill.kv_pool
    result = HandoffBenchResult(asdict(config), str(prefill_path), str(decode_path))
    result.kv_bytes_per_token = pool.num_layers * pool.layout.num_parts * pool.row_bytes
    sender, receiver = links(config.transport)
    try:
        result.us_per_token = time_handoffs(config, prefill, decode, sender, receiver)
    finally:
        close_links(sender, receiver)
    return result


def time_handoffs(
    config: HandoffBenchConfig, prefill: Any, decode: Any, sender: Any, receiver: Any
) -> dict[int, dict[str, float]]:
    """Median microseconds per prompt token of each stage, per prompt length: prompts prefilled on
    `prefill`, handed over the link to `decode` and admitted there."""
    from kvq.runtime.kv_transfer import export_handoff
    from kvq.runtime.sampling import SamplingParams
    from kvq.serve.pd_link import receive_handoff, send_handoff

    pool = prefill.kv_pool
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    us_per_token: dict[int, dict[str, float]] = {}
    gen = torch.Generator().manual_seed(0)
    vocab = prefill.model.config.vocab_size
    for n in config.prompt_tokens:
        runs: dict[str, list[float]] = {stage: [] for stage in (*STAGES, "prefill step")}
        for _ in range(config.repeats + 1):  # the first is a warm-up
            prompt = torch.randint(3, vocab, (n,), generator=gen).tolist()
            seconds: dict[str, float] = {}
            request_id = prefill.add_request(prompt, params)
            start = time.perf_counter()
            prefill.step()  # the prefill: it stays running (max_tokens 2) so its pages can be read
            seconds["prefill step"] = time.perf_counter() - start
            (seq,) = prefill.scheduler.running
            start = time.perf_counter()
            handoff = export_handoff(pool, prompt, seq.block_table, prefill.kv_identity)
            seconds["export"] = time.perf_counter() - start
            prefill.abort(request_id)
            start = time.perf_counter()
            send_handoff(sender, 0, handoff, params)
            seconds["send"] = time.perf_counter() - start
            start = time.perf_counter()
            _, _, meta, _, segment = receiver.recv()
            arrived = receive_handoff(meta, segment)
            seconds["receive"] = time.perf_counter() - start
            start = time.perf_counter()
            decode_id = decode.add_prefilled(arrived, params)  # verifies
            seconds["verify"] = time.perf_counter() - start
            start = time.perf_counter()
            decode._admit_arrived()
            seconds["admit"] = time.perf_counter() - start
            assert decode.scheduler.running, "the handoff was not admitted"
            decode.abort(decode_id)
            for stage, value in seconds.items():
                runs[stage].append(value)
        medians = {stage: statistics.median(v[1:]) * 1e6 / n for stage, v in runs.items()}
        medians["total"] = sum(medians[stage] for stage in STAGES)
        us_per_token[n] = medians
    return us_per_token


def close_links(sender: Any, receiver: Any) -> None:
    """Close both ends of a link at once: a torch link's close waits for the peer's goodbye, which from
    the same thread would only come after that wait; left to exit, gloo threads still receiving abort the
    process ("terminate called without an active exception")."""
    closing = threading.Thread(target=sender.close)
    closing.start()
    receiver.close()
    closing.join()


def links(transport: str) -> tuple[Any, Any]:
    """(the prefill end, the decode end) of `transport`: a pipe (the messages; the pages go through shared
    memory), or a loopback torch.distributed link (`kvq.serve.pd_torch`, the pages inside the messages)."""
    if transport == "shm":
        return Pipe()
    if transport != "torch":
        raise KvqError(f"--transport is {transport!r}; pick shm or torch")
    from kvq.serve.pd_torch import TorchListener, connect_torch

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{probe.getsockname()[1]}"
    listener, accepted = TorchListener(addr), []
    accept = threading.Thread(target=lambda: accepted.append(listener.accept()))
    accept.start()  # both ends join the group at once
    prefill = connect_torch(addr)
    accept.join()
    return prefill, accepted[0]


def render_handoff(result: HandoffBenchResult) -> Table:
    config = result.config
    title = f"kvq bench handoff --model {config['model']} --transport {config['transport']}"
    table = Table(title=f"{title} (µs per prompt token, median)")
    table.add_column("prompt tokens", justify="right")
    for stage in (*STAGES, "total", "prefill step"):
        table.add_column(stage, justify="right")
    table.add_column("total / prefill", justify="right")
    for n, us in result.us_per_token.items():
        cells = [f"{us[stage]:.2f}" for stage in (*STAGES, "total", "prefill step")]
        table.add_row(str(n), *cells, f"{us['total'] / us['prefill step']:.1%}")
    table.caption = f"KV bytes per token: {result.kv_bytes_per_token}"
    return table


@field_options(HandoffBenchConfig, "options")
def bench_handoff_command(
    prompt_tokens: Annotated[str, typer.Option(help="Prompt lengths, comma-separated.")] = ",".join(
        map(str, HandoffBenchConfig.prompt_tokens)
    ),
    *,
    options: GivenOptions,
    json_out: JsonOption = None,
) -> None:
    """The prefill/decode handoff's cost per prompt token, stage by stage (export, send and receive over
    --transport, verify, admit), next to the prefill step's time per token."""
    try:
        lengths = tuple(int(n) for n in prompt_tokens.split(","))
    except ValueError as e:
        raise KvqError(
            f"--prompt-tokens is {prompt_tokens!r}; pass comma-separated integers like 128,512"
        ) from e
    config = HandoffBenchConfig(prompt_tokens=lengths, **options.values)
    if not lengths or min(lengths) < 2 or config.repeats < 1:
        raise KvqError("--prompt-tokens must be at least 2 each and --repeats at least 1")
    result = run_handoff_bench(config)
    console.print(render_handoff(result))
    write_json(result, json_out)
