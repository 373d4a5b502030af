"""The libraries kvq must agree with: compressed-tensors' W4A16 quantizer and decompressors.

Imported lazily by tests (llm-compressor takes seconds to import). llm-compressor's model_free_ptq runner
lives in `kvq.bench.compress` (the benchmark runs it too).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


def w4a16_scheme(group_size: int, targets: list[str] | None = None):
    """The W4A16 preset with `group_size`, normalized the way model_free_ptq normalizes it."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from llmcompressor.entrypoints.model_free.validate import validate_config

    scheme = preset_name_to_scheme("W4A16", targets or ["Linear"])
    scheme.weights.group_size = group_size
    config = validate_config(QuantizationConfig(config_groups={"group_0": scheme}), None, [])
    return config.config_groups["group_0"]


def library_quantize(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """`weight_packed`, `weight_scale`, `weight_shape` as model_free_ptq computes them for one Linear."""
    from compressed_tensors.compressors import compress_module
    from llmcompressor.entrypoints.model_free.lifecycle import calibrate_weight, initialize_quantized_linear

    module = initialize_quantized_linear(weight, w4a16_scheme(group_size), "cpu")
    calibrate_weight(module)
    compress_module(module)
    return dict(module.state_dict().items())


def load_all(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every shard in `root`."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(root).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def library_decompress(tensors: dict[str, torch.Tensor], module: str, scheme) -> torch.Tensor:
    """compressed-tensors' own decompressor (by the scheme's format) applied to one module's tensors."""
    from compressed_tensors.compressors import BaseCompressor

    local = {
        name.removeprefix(module + "."): t for name, t in tensors.items() if name.rpartition(".")[0] == module
    }
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    return compressor.decompress(local, scheme)["weight"]
