"""Run by vLLM's own Python (a separate venv): greedy ids of a checkpoint for given prompt ids, as JSON.

`python tests/vllm_greedy.py MODEL MAX_TOKENS PROMPTS_JSON KV_CACHE_DTYPE` prints one line
`IDS [[...], ...]`. Imports only vLLM: the kvq venv is not visible from here.
"""

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    model, max_tokens, prompts, kv_cache_dtype = (
        sys.argv[1],
        int(sys.argv[2]),
        json.loads(sys.argv[3]),
        sys.argv[4],
    )
    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=512,
        enforce_eager=True,
        gpu_memory_utilization=0.25,  # on CPU: the share of RAM vLLM takes (default 0.92)
        seed=0,
        kv_cache_dtype=kv_cache_dtype,
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens)
    )
    print("IDS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which re-imports this file
    main()
