"""Decode speed of two kvq source trees side by side, in one run: INT4 decode tok/s at concurrency 1 and 32
and host milliseconds per token early and late in one long completion.

    python scripts/decode_ab.py OLD_TREE NEW_TREE MODEL [--repeats 3] [--long-tokens 2048]
        [--kv-cache-dtype bf16]

Each measurement runs in a fresh process with `PYTHONPATH=<tree>`, the two trees taking turns (A B A B),
so drift on a shared machine hits both alike; medians are printed with each tree's spread. Only the
public `Engine` API both trees have is used; the model forward is timed by wrapping `engine.runner.forward`
here, so host time (step wall time minus forward) is measured the same way on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import faulthandler; faulthandler.enable()
import json, statistics, sys, time
import torch
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams

model, new_tokens, long_tokens, window, threads = sys.argv[1], *map(int, sys.argv[2:6])
kv_cache_dtype = sys.argv[6]
PROMPT = "Tell me about the history of the city of Paris."


def engine(**kwargs):
    return Engine(EngineConfig(model=model, threads=threads, kv_cache_dtype=kv_cache_dtype, **kwargs))


def tok_s(batch):
    e = engine(kv_memory=64 << 20, max_num_seqs=batch)
    texts = [PROMPT] if batch == 1 else [f"{PROMPT} ({i})" for i in range(batch)]
    prompts = [e.encode_chat(t) for t in texts]
    run = lambda n: e.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    run(8)
    start = time.perf_counter(); run(1); middle = time.perf_counter(); run(new_tokens)
    return batch * (new_tokens - 1) / (time.perf_counter() - middle - (middle - start))


def host_ms():
    e = engine(kv_memory=256 << 20, max_num_seqs=1)
    forward, spent = e.runner.forward, [0.0]

    def timed(batch):
        start = time.perf_counter()
        try:
            return forward(batch)
        finally:
            spent[0] += time.perf_counter() - start

    e.runner.forward = timed
    e.add_request(e.encode_chat(PROMPT), SamplingParams(max_tokens=long_tokens, ignore_eos=True))
    host = []
    while e.has_unfinished_requests():
        before, start = spent[0], time.perf_counter()
        e.step()
        host.append(time.perf_counter() - start - (spent[0] - before))
    decode = host[1:]
    return 1e3 * statistics.median(decode[:window]), 1e3 * statistics.median(decode[-window:])


first, last = host_ms()
result = {"c=1 tok/s": tok_s(1), "c=32 tok/s": tok_s(32), "host ms first": first, "host ms last": last}
print(json.dumps(result))
"""


def measure(tree: str, args: argparse.Namespace) -> dict[str, float]:
    tree = os.path.abspath(tree)
    env = {**os.environ, "PYTHONPATH": tree}
    numbers = (args.new_tokens, args.long_tokens, args.window, args.threads)
    argv = [os.path.abspath(args.model), *map(str, numbers), args.kv_cache_dtype]
    # cwd = the tree: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *argv], env=env, cwd=tree, capture_output=True, text=True
    )
    if out.returncode != 0:
        sys.exit(f"{tree}: exit {out.returncode}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old_tree")
    parser.add_argument("new_tree")
    parser.add_argument("model", help="an INT4 checkpoint (e.g. kvq compress --recipe w4a16-linear)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="bf16", help="EngineConfig.kv_cache_dtype of every run")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    start = time.perf_counter()
    for _ in range(args.repeats):
        for name, tree in (("old", args.old_tree), ("new", args.new_tree)):
            runs[name].append(measure(tree, args))
    print(f"{args.repeats} runs each, {time.perf_counter() - start:.0f} s; median [min, max]")
    for key in runs["old"][0]:
        cells = []
        for name in ("old", "new"):
            values = [r[key] for r in runs[name]]
            cells.append(f"{name} {statistics.median(values):8.3f} [{min(values):.3f}, {max(values):.3f}]")
        ratio = statistics.median(r[key] for r in runs["new"]) / statistics.median(
            r[key] for r in runs["old"]
        )
        print(f"{key:14s} " + "  ".join(cells) + f"  new/old {ratio:.2f}x")


if __name__ == "__main__":
    main()
