"""vLLM's CPU build as a `kvq bench decode` contender: BF16 weights, the same chat prompt token ids, the same
measure (`decode_speed.decode_tok_s`: (N - 1) / (t(N) - t(1)) per request, greedy, EOS ignored) at
concurrency 1 and `batch_seqs`, in a subprocess of the opt-in vLLM venv (`make test-vllm` builds one;
vLLM's torch differs from kvq's). Also recorded: the CPU capability vLLM's torch reports, i.e. the ISA its
kernels ran with (on AVX2 machines its BF16 Linears fall back to torch's, and it runs no INT4).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from kvq.errors import KvqError

_SCRIPT = """
import importlib.util, json, sys
import torch
from vllm import LLM, SamplingParams

args = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location("decode_speed", args["decode_speed"])  # kvq's measure, as is
decode_speed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(decode_speed)
decode_tok_s = decode_speed.decode_tok_s
torch.set_num_threads(args["threads"])
# gpu_memory_utilization: on CPU the share of RAM vLLM reserves (default 0.92, refused at start on a box
# with less than that free; a 32 x 1024-token KV cache needs a sliver of 0.25)
llm = LLM(args["model"], dtype="bfloat16", max_model_len=1024, max_num_seqs=max(args["batch_seqs"], 1),
          enforce_eager=True, seed=0, gpu_memory_utilization=0.25)

def contender(num_seqs):
    prompts = [{"prompt_token_ids": args["prompt_ids"]}] * num_seqs
    return lambda n: llm.generate(
        prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)

result = {"vllm": __import__("vllm").__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
for key, num_seqs, tokens in (("c=1", 1, args["new_tokens"]),
                              (f"c={args['batch_seqs']}", args["batch_seqs"], args["batch_new_tokens"])):
    result[key] = decode_tok_s({"vllm": contender(num_seqs)}, num_seqs, tokens, args["repeats"])["vllm"]
print("KVQ_RESULT " + json.dumps(result))
"""


def vllm_decode(
    python: Path,
    model: Path,
    prompt_ids: list[int],
    *,
    threads: int,
    repeats: int,
    new_tokens: int,
    batch_seqs: int,
    batch_new_tokens: int,
) -> dict:
    """vLLM BF16 decode tok/s runs at concurrency 1 and batch_seqs (keys "c=1", "c=N"), its version and
    torch's CPU capability, from `python` (the vLLM venv's interpreter)."""
    if not Path(python).is_file():
        raise KvqError(
            f"--vllm-python {python}: no such interpreter; build the vLLM venv with make test-vllm"
        )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0))[:threads])),
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    args = {
        "decode_speed": str(Path(__file__).with_name("decode_speed.py")),
        "model": str(model),
        "prompt_ids": prompt_ids,
        "threads": threads,
        "repeats": repeats,
        "new_tokens": new_tokens,
        "batch_seqs": batch_seqs,
        "batch_new_tokens": batch_new_tokens,
    }
    done = subprocess.run(
        [str(python), "-c", _SCRIPT, json.dumps(args)], env=env, capture_output=True, text=True
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("KVQ_RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise KvqError(f"vLLM's decode run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(line.removeprefix("KVQ_RESULT "))
