"""Bad input to `kvq compress --method gptq`: one clear error naming what is wrong and the fix, SRC untouched,
nothing under a final shard name."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.compress.recipe import RECIPES_DIR, load_recipe
from kvq.errors import KvqError
from kvq.gptq.gptq_config import GptqConfig
from kvq.gptq.gptq_job import prepare_gptq, run_gptq
from tests.calibrate.test_errors import snapshot
from tests.conftest import TinyCheckpoint
from tests.test_cli_errors import assert_one_line_error, run_kvq


@pytest.mark.parametrize(
    "args, fragments",
    [
        (
            ["--method", "gptq", "--num-samples", "2", "--seq-len", "64"],
            [
                "128 calibration tokens, fewer than the 576 inputs of model.layers.0.mlp.down_proj",
                "--num-samples",
            ],
        ),
        (["--method", "gptq", "--seq-len", "9000"], ["--seq-len 9000 exceeds", "4096"]),
        (["--method", "gptq", "--dataset", "missing.txt"], ["missing.txt", "no such dataset file"]),
        (["--num-samples", "4"], ["--num-samples only apply to --method gptq"]),
        (["--method", "awq"], ["--method 'awq' is unknown"]),
        (["--method", "gptq", "--moe-min-tokens", "-1"], ["--moe-min-tokens must be 0 or more"]),
        (["--method", "gptq", "--gptaq-alpha", "0.5"], ["--gptaq-alpha only applies to --method gptaq"]),
        (["--method", "gptaq", "--gptaq-alpha", "1.5"], ["--gptaq-alpha must be in [0, 1], got 1.5"]),
    ],
)
def test_cli_errors(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, args: list[str], fragments: list[str]
) -> None:
    src = tiny_checkpoint("llama", "bf16")
    before = snapshot(src)
    out = tmp_path / "out"
    args = [str(tmp_path / a) if a.endswith(".txt") else a for a in args]
    result = run_kvq("compress", str(src), str(out), "--recipe", "w4a16-linear", "--group-size", "64", *args)
    assert_one_line_error(result, *fragments)
    assert not out.exists() and snapshot(src) == before


def test_gptq_recipe_with_rtn_method(tiny_checkpoint: TinyCheckpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("llama", "bf16")
    result = run_kvq(
        "compress", str(src), str(tmp_path / "o"), "--recipe", "w4a16-linear-gptq", "--method", "rtn"
    )
    assert_one_line_error(result, "w4a16-linear-gptq.yaml", "is a GPTQModifier", "drop --method rtn")


def test_truncated_source_shard(tiny_checkpoint: TinyCheckpoint, tmp_path: Path) -> None:
    import shutil

    src = Path(shutil.copytree(tiny_checkpoint("llama", "bf16"), tmp_path / "src"))
    shard = src / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    result = run_kvq("compress", str(src), str(tmp_path / "o"), "--recipe", "w4a16-linear-gptq")
    assert_one_line_error(result, "model-00002-of-00003.safetensors")


def test_singular_hessian_names_the_module_and_the_fix(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    """One word repeated: every token's input to a layer-0 Linear is the same vector, so without
    dampening its Hessian is singular."""
    src = tiny_checkpoint("llama", "bf16")
    before = snapshot(src)
    recipe = tmp_path / "undamped.yaml"
    recipe.write_text((RECIPES_DIR / "w4a16-linear-gptq.yaml").read_text().replace("0.01", "0.0"))
    dataset = tmp_path / "same.txt"
    dataset.write_text(" ".join(["the"] * 3000))
    config = GptqConfig(CalibrationConfig(dataset=dataset, num_samples=10, seq_len=64))
    out = tmp_path / "out"
    with pytest.raises(
        KvqError, match=r"model\.layers\.0\..* is not positive definite .* raise dampening_frac"
    ):
        run_gptq(prepare_gptq(src, out, load_recipe(str(recipe), 64), config), 1)
    assert not list(out.glob("*.safetensors")) and snapshot(src) == before
