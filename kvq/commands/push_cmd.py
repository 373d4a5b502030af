"""`kvq push DIR REPO_ID`: publish a kvq output to the Hugging Face Hub with a model card of measured numbers.

Order: check REPO_ID, verify the folder against its manifest (every shard's size and sha256, a
calibration whole), check the engines asked for (`--require-engine`), build the card (README.md) from
the manifest, config and `--eval` report, choose the files (the checkpoint's own, `kvq.push.files`;
others only by `--include`, dotfiles never), then either print card and file list (`--dry-run`: no
connection) or upload those files and the card with huggingface_hub (a re-run resumes). DIR is never
written to: the card goes up from memory. Imports huggingface_hub's card classes; torch only through
the checkpoint validation (transformers' meta model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvq.byte_sizes import format_bytes
from kvq.checkpoint.validate import validate_dir
from kvq.commands.render import console
from kvq.errors import KvqError


def push_command(
    path: Annotated[Path, typer.Argument(help="A kvq compress output directory (calibrated or not).")],
    repo_id: Annotated[str, typer.Argument(help="The Hub repository, e.g. my-org/SmolLM2-135M-w4a16.")],
    eval_report: Annotated[
        Path | None,
        typer.Option("--eval", help="The `kvq eval DIR ... --json` report of this checkpoint, for the card."),
    ] = None,
    base_model: Annotated[
        str | None,
        typer.Option(help="The source model's Hub id (default: from the source's Hub cache path)."),
    ] = None,
    license: Annotated[
        str | None, typer.Option(help="License id, e.g. apache-2.0 (default: the source card's or config's).")
    ] = None,
    private: Annotated[bool, typer.Option("--private", help="Create the repository private.")] = False,
    revision: Annotated[str | None, typer.Option(help="Branch to push to (created if needed).")] = None,
    require_engine: Annotated[
        list[str] | None,
        typer.Option(
            help="Refuse to push unless `kvq check` says this engine loads it at --tp (repeatable): "
            "vllm, sglang, transformers or kvq."
        ),
    ] = None,
    tp: Annotated[int, typer.Option(help="Tensor-parallel size --require-engine checks.")] = 1,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the card and the file list; write and send nothing.")
    ] = False,
    include: Annotated[
        list[str] | None,
        typer.Option(
            help="Also upload the files this glob matches, relative to DIR, e.g. 'docs/*.md' (repeatable). "
            "Without it only the checkpoint goes: the files its manifest and index list, config, "
            "tokenizer, generation config, chat template, license. Dotfiles are never uploaded.",
        ),
    ] = None,
) -> None:
    """Verify DIR against its manifest, write its model card, and upload the checkpoint to the Hugging Face
    Hub."""
    from kvq.push.card import CARD_NAME, build_card
    from kvq.push.files import select_files
    from kvq.push.upload import check_repo_id, hub_token, upload
    from kvq.push.verify import index_weight_map, verify_output

    check_repo_id(repo_id)
    manifest = verify_output(path)
    validate_dir(path)  # the tensors are what config.json describes (the card's commands rely on it)
    if require_engine:
        _require_engines(path, require_engine, tp)
    report = _read_report(eval_report) if eval_report is not None else None
    card = build_card(path, manifest, repo_id, report, base_model, license)
    selection = select_files(path, manifest, index_weight_map(path), include or ())
    _print_left_out(selection.left_out, selection.dotfiles)
    files = sorted(set(selection.files) | {CARD_NAME})
    if dry_run:
        typer.echo(card.content)
        console.print(f"would upload {len(files)} files to {repo_id}:")
        for name in files:
            size = len(card.content.encode()) if name == CARD_NAME else (path / name).stat().st_size
            console.print(f"  {name}  {format_bytes(size)}")
        return
    token = hub_token()
    recipe = manifest.get("recipe") or {}
    message = (
        f"kvq push: {recipe.get('name')} (group {recipe.get('group_size')}) of {card.data.get('base_model')}"
    )
    url = upload(
        path,
        files,
        repo_id,
        (CARD_NAME, card.content),
        private=private,
        revision=revision,
        token=token,
        commit_message=message,
    )
    console.print(f"uploaded {len(files)} files to {repo_id}: {url}")


def _print_left_out(left_out: list[str], dotfiles: list[str]) -> None:
    """Name what stays home, on stderr (stdout of --dry-run is the card and the list)."""
    if left_out:
        typer.echo(
            f"not uploaded (not part of the checkpoint; --include PATTERN sends one): {', '.join(left_out)}",
            err=True,
        )
    if dotfiles:
        typer.echo(f"not uploaded (dotfiles never are): {', '.join(dotfiles)}", err=True)


def _read_report(path: Path) -> dict:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise KvqError(f"{path}: no such file; pass the JSON that kvq eval --json wrote") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KvqError(f"{path}: not JSON ({e}); pass the file that kvq eval --json wrote") from e
    if not isinstance(report, dict) or not {"model", "runs", "settings"} <= report.keys():
        raise KvqError(
            f"{path}: not a kvq eval report (no model/runs/settings); pass kvq eval --json's output"
        )
    return report


def _require_engines(path: Path, engines: list[str], tp: int) -> None:
    from kvq.check import check_checkpoint

    report = check_checkpoint(path, engines, tp)
    failing = [e for e in engines if not report.loads(e)]
    if failing:
        details = "\n".join(report.lines())
        raise KvqError(
            f"{path}: at tp {tp}, {', '.join(failing)} would not load it, so it is not pushed:\n{details}"
        )
