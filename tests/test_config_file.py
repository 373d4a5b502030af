"""Serving configs (`configs/*.yaml`, `kvq.config_file`): every shipped config loads and its settings build
the engine and server configs; unknown keys and bad values are one-line errors naming the file and key;
flags override the file (`kvq generate --config`); `kvq plan --config` on each reference deployment
fits its GPUs (and says so when it does not); paper deployments are refused by `kvq serve`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvq.cli import build_app
from kvq.config_file import ENGINE_KEYS, load_config
from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig
from kvq.serve.server_config import ServerConfig
from tests.test_cli_errors import assert_one_line_error, run_kvq, run_kvq_in_process

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DATA = ROOT / "tests" / "compress" / "data"
DEPLOYMENTS = {  # config -> the model's config.json that `kvq plan` reads on paper
    "glm5-int4-fp8kv-tp8-h200.yaml": DATA / "glm-5.1-config.json",
    "kimi-k2.6-int4-tp8-h200.yaml": DATA / "kimi-k2.6-config.json",
}


def test_engine_keys_are_the_engine_configs_fields() -> None:
    assert set(ENGINE_KEYS) == {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_shipped_config_loads(path: Path, smollm2) -> None:
    config = load_config(path)
    server = ServerConfig(**config.server)
    assert server.served_model_name
    # the engine settings are valid EngineConfig values (checked on a model directory that exists here)
    engine = EngineConfig(model=str(smollm2.bf16), **config.engine)
    if config.deployment is None:
        assert config.model in ("embedded:smollm2", "embedded:smollm2-int4") and server.is_loopback
        assert engine.kv_memory is not None and engine.threads == 2
    else:
        assert config.deployment.tp == 8 and config.deployment.gpu == "H200" and path.name in DEPLOYMENTS
    assert len(CONFIGS) == 4


def test_embedded_smollm2_resolves_to_the_built_model(smollm2) -> None:
    assert load_config(ROOT / "configs" / "smollm2-cpu.yaml").model_dir() == smollm2.bf16


def _plan(*args: str) -> tuple[int, str]:
    """`kvq plan ARGS` in-process (a subprocess re-imports everything: minutes on a loaded machine)."""
    result = CliRunner().invoke(build_app(), ["plan", *args], catch_exceptions=False)
    return result.exit_code, result.output


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_kvq_plan_on_each_reference_deployment_fits_its_gpus(name: str) -> None:
    code, output = _plan(str(DEPLOYMENTS[name]), "--config", str(ROOT / "configs" / name), "--json")
    assert code == 0, output
    plan = json.loads(output[output.index("{") :])
    fit = plan["deployment"]
    config = load_config(ROOT / "configs" / name)
    assert fit["fits"] and fit["kv_cache_dtype"] == config.engine["kv_cache_dtype"]
    assert fit["kv_tokens"] >= fit["max_model_len"] == config.engine["max_model_len"]
    serving = plan["serving"]
    assert serving["tp"] == 8 and serving["gpu_mem_bytes"] == 141 * 10**9
    assert serving["mem_fraction"] == config.deployment.mem_fraction
    assert serving["weight_bytes_per_gpu"] < 0.88 * 141e9


def test_kvq_plan_flags_override_the_deployment() -> None:
    name = "kimi-k2.6-int4-tp8-h200.yaml"  # already compressed: the cheaper plan
    config = str(ROOT / "configs" / name)
    code, output = _plan(str(DEPLOYMENTS[name]), "--config", config, "--gpu-mem", "48GB")
    assert code == 1 and "does NOT fit" in output, output


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("modle: x\n", ("unknown key modle", "model, engine, server, deployment")),
        ("engine: {kv_dtype: bf16}\n", ("unknown key engine.kv_dtype", "kv_cache_dtype")),
        ("server: {port: 70000}\n", ("server.port must be in [0, 65535]",)),
        ("server: {api_kee: x}\n", ("unknown key server.api_kee",)),
        ("deployment: {tp: 8}\n", ("deployment needs tp and gpu_mem",)),
        ("deployment: {tp: 0, gpu_mem: 80GB}\n", ("deployment.tp must be >= 1",)),
        ("- a list\n", ("expected a mapping",)),
        ("engine: [1]\n", ("engine must be a mapping",)),
    ],
)
def test_bad_configs_name_the_file_and_key(tmp_path: Path, text: str, fragments: tuple[str, ...]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(KvqError) as caught:
        load_config(path)
    assert str(path) in str(caught.value)
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_generate_reads_the_config_and_flags_override_it(tiny_checkpoint, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama", "bf16")
    config = tmp_path / "tiny.yaml"
    config.write_text(f"model: {model}\nengine: {{kv_memory: 1MiB, dtype: float32, kv_integrity: tags}}\n")
    from_file = run_kvq("generate", "--config", str(config), "hello", "--max-tokens", "3", "--no-chat")
    # the rest in-process (same `main`, no interpreter start): the file is read by the same code either way
    given = run_kvq_in_process(
        "generate", str(model), "hello", "--max-tokens", "3", "--no-chat", "--dtype", "float32"
    )
    assert from_file.returncode == 0 and given.returncode == 0, from_file.stderr + given.stderr
    assert from_file.stdout == given.stdout and from_file.stdout.strip()
    overridden = run_kvq_in_process("generate", "--config", str(config), "hello", "--kv-integrity", "bogus")
    assert_one_line_error(overridden, "--kv-integrity 'bogus': pick one of off, tags, full")
    (tmp_path / "typo.yaml").write_text("engine: {kv_memroy: 1MiB}\n")
    typo = run_kvq_in_process("generate", "--config", str(tmp_path / "typo.yaml"), "hi")
    assert_one_line_error(typo, "unknown key engine.kv_memroy")


def test_serve_and_generate_refuse_a_paper_deployment() -> None:
    path = ROOT / "configs" / "glm5-int4-fp8kv-tp8-h200.yaml"
    # serve as a process (a serve that did not refuse would not return); generate through the same main
    assert_one_line_error(run_kvq("serve", "--config", str(path)), "tensor parallel", "kvq plan --config")
    refused = run_kvq_in_process("generate", "--config", str(path), "hi")
    assert_one_line_error(refused, "tensor parallel", "kvq plan --config")
