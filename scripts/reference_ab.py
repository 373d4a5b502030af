"""The outputs of two kvq source trees on the tiny fixtures, compared bit for bit: every architecture of
`kvq.fixtures` (llama, glm4_moe, glm_moe_dsa, deepseek_v3) as BF16, FP8-block and kvq compress's INT4, each
run in fp32 reference mode (`--dtype float32`) and on the default fast path with BF16 and FP8 KV pages (scale
1 where the checkpoint has none), three prompts decoded together,
greedy, with the top-5 log-probabilities of every prompt and generated token.

    python scripts/reference_ab.py OLD_TREE NEW_TREE [--work DIR] [--max-tokens 16]

The checkpoints are written once under --work by NEW_TREE's kvq; each tree then runs every one in a fresh
process with `PYTHONPATH=<tree>`. Prints one line per run (same or the first difference) and exits 1 when
any differs. Only the public `Engine` API both trees have is used.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams

model, dtype, kv_cache_dtype, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
config = EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_memory="32MiB", threads=1)
engine = Engine(config)
params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=5, prompt_logprobs=5)
prompts = [[1, 5, 9, 200, 31, 7], [3] * 40 + [77, 12], list(range(100, 121))]
ids = [engine.add_request(p, params) for p in prompts]
found = {i: {"tokens": [], "logprobs": []} for i in ids}
while engine.has_unfinished_requests():
    for out in engine.step():
        entry = found[out.request_id]
        entry["tokens"] = out.token_ids
        for lp in (out.prompt_logprobs or []) + (out.logprobs or []):
            entry["logprobs"].append([lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]])
print(json.dumps([found[i] for i in ids]))
"""

RECIPES = {"llama": "w4a16-linear"}  # the MoE architectures: w4a16-experts
MODES = (("float32", "auto"), ("auto", "auto"), ("auto", "fp8_e4m3"))  # (--dtype, --kv-cache-dtype)


def build(work: Path, new_tree: str) -> list[Path]:
    """BF16, FP8-block and INT4 checkpoints of every fixture architecture under `work` (kept between runs)."""
    env = {**os.environ, "PYTHONPATH": new_tree}
    code = (
        "import sys; from pathlib import Path; from kvq.fixtures.checkpoint_fixtures import build_fixture; "
        "build_fixture(sys.argv[1], sys.argv[2], Path(sys.argv[3]))"
    )
    out = []
    for arch in ("llama", "glm4_moe", "glm_moe_dsa", "deepseek_v3"):
        for fmt in ("bf16", "fp8-block"):
            path = work / f"{arch}-{fmt}"
            if not path.exists():
                subprocess.run(
                    [sys.executable, "-c", code, arch, fmt, str(path)], env=env, cwd=new_tree, check=True
                )
            out.append(path)
        int4 = work / f"{arch}-int4"
        if not int4.exists():
            recipe = RECIPES.get(arch, "w4a16-experts")
            argv = ["-m", "kvq", "compress", str(work / f"{arch}-bf16"), str(int4), "--recipe", recipe]
            subprocess.run(
                [sys.executable, *argv, "--group-size", "32", "--quiet"], env=env, cwd=new_tree, check=True
            )
        out.append(int4)
    return out


def run(tree: str, model: Path, mode: tuple[str, str], max_tokens: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    # cwd = the tree: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH
    argv = [sys.executable, "-c", CHILD, str(model), *mode, str(max_tokens)]
    done = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{tree} on {model.name} ({mode}): exit {done.returncode}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_difference(old: list[dict], new: list[dict]) -> str | None:
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        if a["tokens"] != b["tokens"]:
            return f"prompt {i}: tokens {a['tokens']} vs {b['tokens']}"
        for j, (x, y) in enumerate(zip(a["logprobs"], b["logprobs"], strict=True)):
            if x != y:
                return f"prompt {i}, position {j}: {x} vs {y}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old_tree")
    parser.add_argument("new_tree")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvq-reference-ab"))
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    old_tree, new_tree = os.path.abspath(args.old_tree), os.path.abspath(args.new_tree)
    args.work.mkdir(parents=True, exist_ok=True)
    differ = 0
    for model in build(args.work, new_tree):
        for mode in MODES:
            old, new = (run(t, model, mode, args.max_tokens) for t in (old_tree, new_tree))
            found = first_difference(old, new)
            differ += found is not None
            num = sum(len(r["logprobs"]) for r in new)
            print(
                f"{model.name:22s} {' / '.join(mode):17s} "
                + (f"DIFFERS: {found}" if found else f"same ({num} positions)")
            )
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
