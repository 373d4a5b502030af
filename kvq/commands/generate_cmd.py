"""`kvq generate [MODEL] "prompt" [--config FILE]`: stream a completion from the runtime engine to stdout."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvq.checkpoint.validate import validate_dir
from kvq.commands.config_options import ConfigOption, model_dir, read_config, refuse_paper_deployment
from kvq.commands.engine_options import engine_options
from kvq.commands.field_options import GivenOptions
from kvq.commands.utf8_arguments import check_utf8
from kvq.errors import KvqError
from kvq.runtime.config import ENGINE_OPTIONS, EngineConfig
from kvq.runtime.sampling_params import SamplingParams


@engine_options(*(name for name in ENGINE_OPTIONS if name != "max_num_seqs"))  # one request: max_num_seqs 1
def generate_command(
    model_or_prompt: Annotated[
        str, typer.Argument(metavar="[MODEL] PROMPT", help="Checkpoint directory (omit it with --config).")
    ],
    prompt: Annotated[
        str | None, typer.Argument(help="The user message (sent through the chat template if any).")
    ] = None,
    config: ConfigOption = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = SamplingParams.max_tokens,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = SamplingParams.temperature,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (1 is off).")] = SamplingParams.top_p,
    top_k: Annotated[
        int, typer.Option(help="Sample from the k most likely tokens (0 is off).")
    ] = SamplingParams.top_k,
    seed: Annotated[int | None, typer.Option(help="Seed of this request's sampler.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable); not printed.")] = None,
    *,
    engine: GivenOptions,
    chat: Annotated[bool, typer.Option(help="Use the tokenizer's chat template when it has one.")] = True,
) -> None:
    """Generate a completion for one prompt, streaming the text as it is produced."""
    if max_tokens < 1:  # a request may score its prompt only (0); a command that prints a completion may not
        raise KvqError(f"--max-tokens must be >= 1, got {max_tokens}")
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_tokens": max_tokens}
    params = _sampling_params(**sampling, seed=seed, stop=list(stop or []))
    file = read_config(config)
    refuse_paper_deployment(file, "generate")
    if prompt is None:  # one positional: the prompt, the model from --config
        model, prompt = None, model_or_prompt
    else:
        model = Path(model_or_prompt)
    check_utf8(prompt, "PROMPT")
    for text in stop or []:
        check_utf8(text, f"--stop {text!r}")
    path = model_dir(model, file)
    settings = engine.over(file.engine if file else {})
    engine_config = EngineConfig(model=str(path), **{**settings, "max_num_seqs": 1})
    validate_dir(path)  # a checkpoint that contradicts its config.json is refused by name, before loading
    from kvq.runtime.distributed.worker import follow_under_launcher
    from kvq.runtime.engine import Engine  # transformers and the model code: once every flag passed

    follow_under_launcher(engine_config)  # under torchrun, ranks past 0 end here
    runtime = Engine(engine_config)
    token_ids = runtime.encode_chat(prompt) if chat else runtime.encode(prompt)
    error = None
    for out in runtime.stream(token_ids, params):
        sys.stdout.write(out.delta)
        sys.stdout.flush()
        error = out.error
    sys.stdout.write("\n")
    if error is not None:  # finish reason "error": the text above is what came before it
        print(f"kvq: error: generation stopped: {error}", file=sys.stderr)
        raise typer.Exit(1)


def _sampling_params(**fields: object) -> SamplingParams:
    """`SamplingParams`, its refusals naming the flag as typed (`--max-tokens`, not the request field)."""
    try:
        return SamplingParams(**fields)  # type: ignore[arg-type]
    except KvqError as e:
        name, _, rest = str(e).partition(" ")
        if name in fields:
            raise KvqError(f"--{name.replace('_', '-')} {rest}") from None
        raise
