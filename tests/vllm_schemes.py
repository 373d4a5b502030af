"""Run by vLLM's own Python (a separate venv): vLLM's answers to the questions kvq check answers, as JSON.

`python tests/vllm_schemes.py < cases.json` prints one line `ANSWERS [...]`. Each case gives a
checkpoint's quantization_config, its Linear layers (name, vLLM class), MoE layers (name, hidden,
intermediate size per TP rank, group size) and FP8-block layers (name, sizes per rank). The answers come
from vLLM's `CompressedTensorsConfig.get_scheme` / `get_scheme_dict`, its predicates `get_moe_method`
uses, `check_moe_marlin_supports_config` and `validate_fp8_block_shape`. Imports only vLLM and torch.
"""

import copy
import json
import sys
from types import SimpleNamespace

FUSED = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
}


def _error(e: Exception) -> str:
    return f"error: {type(e).__name__}: {e}"


def answer(case: dict) -> dict:
    import torch
    import vllm.distributed
    from compressed_tensors import CompressionFormat
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 import (
        WNA16_SUPPORTED_BITS,
    )
    from vllm.model_executor.layers.quantization.utils.fp8_utils import validate_fp8_block_shape
    from vllm.model_executor.layers.quantization.utils.marlin_utils import check_moe_marlin_supports_config

    config = CompressedTensorsConfig.from_config(copy.deepcopy(case["quantization_config"]))
    config.packed_modules_mapping = FUSED

    def module(cls: str) -> torch.nn.Module:
        return type(cls, (torch.nn.Module,), {})()

    schemes = {}
    for name, cls in case["linear"]:
        try:
            scheme = config.get_scheme(module(cls), name)
            schemes[name] = type(scheme).__name__ if scheme is not None else "unquantized"
        except Exception as e:  # noqa: BLE001 - the answer is the error vLLM raises
            schemes[name] = _error(e)
    config._add_fused_moe_to_target_scheme_map()
    moe = {}
    for name in case["moe"]:
        try:
            dicts = [
                config.get_scheme_dict(module("RoutedExperts"), f"{name}.0.{p}")
                for p in ("gate_proj", "up_proj", "down_proj")
            ]
            if not all(d == dicts[0] for d in dicts):
                moe[name] = "error: All MoE projections need to have same quantization scheme"
            elif dicts[0] is None:
                moe[name] = "UnquantizedFusedMoEMethod"
            else:
                w, i, fmt = dicts[0]["weights"], dicts[0]["input_activations"], dicts[0]["format"]
                is_wna16 = config._is_wNa16_group_channel(w, i)
                ok = w.num_bits in WNA16_SUPPORTED_BITS and fmt == CompressionFormat.pack_quantized.value
                moe[name] = "CompressedTensorsWNA16MoEMethod" if is_wna16 and ok else f"other: {fmt}"
        except Exception as e:  # noqa: BLE001
            moe[name] = _error(e)
    marlin = {
        f"{name}@{tp}": check_moe_marlin_supports_config(
            SimpleNamespace(hidden_dim=hidden, intermediate_size_per_partition_unpadded=per_rank), group
        )
        for name, tp, hidden, per_rank, group in case["marlin"]
    }
    fp8 = {}
    for name, tp, in_size, in_per_rank, out_size, outs_per_rank, block in case["fp8_block"]:
        # its default for a layer without `tp_size` reads the TP group, which this process has not made
        vllm.distributed.get_tensor_model_parallel_world_size = lambda tp=tp: tp
        try:
            validate_fp8_block_shape(
                SimpleNamespace(tp_size=tp), in_size, out_size, in_per_rank, outs_per_rank, block
            )
            fp8[f"{name}@{tp}"] = "ok"
        except ValueError as e:
            fp8[f"{name}@{tp}"] = _error(e)
    return {"schemes": schemes, "moe": moe, "marlin": marlin, "fp8_block": fp8}


def main() -> None:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config

    cases = json.load(sys.stdin)
    config = VllmConfig()
    config.model_config = SimpleNamespace(dtype=torch.bfloat16)  # all CompressedTensorsW8A8Fp8() reads
    with set_current_vllm_config(config):  # scheme constructors read the current config
        answers = [answer(case) for case in cases]
    print("ANSWERS " + json.dumps(answers), flush=True)


if __name__ == "__main__":
    main()
