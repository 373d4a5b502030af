"""Options declared by a settings dataclass (`kvq.commands.field_options`): each `option` field is a flag with
the field's default and help, a command receives them as `GivenOptions` (the given ones apart, to override a
config file), and `EngineConfig`'s options are every engine flag of `kvq serve` and the P/D decode worker."""

from __future__ import annotations

from dataclasses import dataclass

import typer
from typer.testing import CliRunner

from kvq.commands.field_options import GivenOptions, field_options
from kvq.kv_cache_dtypes import check_kv_cache_dtype
from kvq.runtime.config import ENGINE_KEYS, ENGINE_OPTIONS, EngineConfig, option, option_names


@dataclass
class Settings:
    size: str | int | None = option(None, "A size.")
    count: int = option(3, "How many.")
    is_on: bool = option(False, "Switch it on.")
    kv: str = option("auto", "KV dtype.", check=check_kv_cache_dtype)
    hidden: float = 0.5  # no option: a config file's only


def _run(*args: str, help_text: dict[str, str] | None = None) -> tuple[int, str, list[GivenOptions]]:
    seen: list[GivenOptions] = []

    @field_options(Settings, "settings", option_names(Settings), help_text)
    def command(name: str = "x", *, settings: GivenOptions) -> None:
        seen.append(settings)

    app = typer.Typer()
    app.command()(command)
    app.command("other")(lambda: None)  # two commands: `command` is a subcommand
    result = CliRunner().invoke(app, ["command", *args])
    return result.exit_code, result.output, seen


def test_option_fields_become_flags_with_their_defaults() -> None:
    assert option_names(Settings) == ("size", "count", "is_on", "kv")
    code, _, [seen] = _run()
    assert code == 0
    assert seen.values == {"size": None, "count": 3, "is_on": False, "kv": "auto"}
    assert seen.given == {}


def test_given_flags_are_told_apart_and_checked() -> None:
    code, _, [seen] = _run("--count", "3", "--is-on", "--kv", "fp8", "--size", "2MiB")
    assert code == 0
    assert seen.given == {"count": 3, "is_on": True, "kv": "fp8_e4m3", "size": "2MiB"}  # fp8: checked
    assert seen.over({"count": 9, "hidden": 0.1}) == {**seen.given, "hidden": 0.1}


def test_help_shows_each_option_and_a_rewording() -> None:
    code, output, _ = _run("--help", help_text={"count": "How many widgets."})
    assert code == 0
    for text in ("--size", "A size.", "--is-on", "How many widgets.", "--kv"):
        assert text in output
    assert "--no-is-on" not in output and "--hidden" not in output


def test_engine_keys_and_options_come_from_engine_config() -> None:
    assert ENGINE_KEYS[0] == "dtype" and "model" not in ENGINE_KEYS
    assert set(ENGINE_OPTIONS) < set(ENGINE_KEYS)
    assert "kv_memory_fraction" not in ENGINE_OPTIONS  # a config file's only
    assert EngineConfig.page_size == 16  # a field made by `option` keeps its default as a class attribute


def test_the_decode_worker_gets_every_engine_option_that_is_set(tiny_checkpoint) -> None:
    from kvq.serve.pd_roles import engine_flags

    path = tiny_checkpoint("llama", "bf16")
    config = EngineConfig(model=str(path), kv_memory="1MiB", require_kv_scales=True, max_model_len=64)
    flags = engine_flags(config)
    assert "--kv-memory=1048576" in flags and "--require-kv-scales" in flags and "--max-model-len=64" in flags
    assert "--enforce-eager" not in flags and not any(f.startswith("--threads") for f in flags)
    assert {f.split("=")[0].removeprefix("--").replace("-", "_") for f in flags} <= set(ENGINE_OPTIONS)
