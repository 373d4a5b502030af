"""The kvq files one decode step runs through: profile one `Engine.step()` of a decode batch and list every
`kvq/` file a call entered (what docs/runtime.md's table of decode-step files says).

    .venv/bin/python scripts/step_files.py [--arch llama] [--recipe w4a16-linear] [--kv-integrity off]
        [--kernels auto|torch|triton] [--cpu-isa auto|...|torch]

The GPU path's files without a GPU: `TRITON_INTERPRET=1 ... --kernels triton` runs the Triton kernels under
Triton's interpreter on CPU tensors (the same Python files as on CUDA, but for the sampler's argmax, which
runs in C on CPU logits: `kernels/cpu/ops`; `--cpu-isa torch` also keeps the layers off the C small ops).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
from pathlib import Path

import kvq
from kvq.compress.recipe import load_recipe
from kvq.compress.runner import prepare, run
from kvq.fixtures.checkpoint_fixtures import build_fixture
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling_params import SamplingParams

ROOT = Path(kvq.__file__).parent


def step_files(engine: Engine) -> list[str]:
    """The kvq files (relative to kvq/, without .py) entered by the engine's next step."""
    profile = cProfile.Profile()
    profile.runcall(engine.step)
    files = set()
    for filename, _, _ in pstats.Stats(profile).stats:  # type: ignore[attr-defined]
        path = Path(filename)
        if path.suffix == ".py" and path.is_relative_to(ROOT):
            files.add(str(path.relative_to(ROOT).with_suffix("")))
    return sorted(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--recipe", default="w4a16-linear")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--kv-integrity", default="off")
    parser.add_argument("--kernels", default=None, help="EngineConfig.kernels")
    parser.add_argument("--cpu-isa", default=None, help="EngineConfig.cpu_isa")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = build_fixture(args.arch, "bf16", Path(tmp) / "src")
        out = Path(tmp) / "out"
        run(prepare(src, out, load_recipe(args.recipe, args.group_size), "vllm"), 1)
        config = EngineConfig(
            model=str(out),
            kv_memory="16MiB",
            kv_integrity=args.kv_integrity,
            kernels=args.kernels,
            cpu_isa=args.cpu_isa,
        )
        engine = Engine(config)
        for prompt in ([1, 2, 3, 4, 5], [6, 7, 8]):
            engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0))
        engine.step()  # the prefill
        engine.step()  # the first decode step builds the decode plan
        files = step_files(engine)
    print(f"{len(files)} files: {', '.join(files)}")


if __name__ == "__main__":
    main()
