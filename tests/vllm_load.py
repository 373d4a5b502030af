"""Run by vLLM's own Python (a separate venv): does vLLM load a checkpoint, and at --tp N does its config
accept the parallel split.

`python tests/vllm_load.py MODEL TP` prints one line `LOAD ok` or `LOAD error <type>: <message>`. At TP 1
it builds the engine (weights loaded, nothing generated); at TP > 1 only `EngineArgs.create_engine_config`
runs (vLLM's `verify_with_parallel_config`: heads divisible by TP), as a CPU box cannot start the ranks.
Imports only vLLM: the kvq venv is not visible from here.
"""

import sys


def main() -> None:
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    model, tp = sys.argv[1], int(sys.argv[2])
    try:
        if tp == 1:
            LLM(
                model=model,
                dtype="bfloat16",
                max_model_len=128,
                enforce_eager=True,
                gpu_memory_utilization=0.1,
            )
        else:
            EngineArgs(model=model, tensor_parallel_size=tp, max_model_len=128).create_engine_config()
    except Exception as e:  # noqa: BLE001 - any failure to load is the answer
        print(f"LOAD error {type(e).__name__}: {str(e)[:300]!r}", flush=True)
        return
    print("LOAD ok", flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which re-imports this file
    main()
