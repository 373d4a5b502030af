"""KV-cache scale rules every engine shares: the `kv_cache_scheme` the engines accept, where the calibrated
`k_scale` / `v_scale` tensors must sit to be found, and what MLA / DSA models do with them."""

from __future__ import annotations

import re

from kvq.check.report import ERROR, NOTE, WARNING, EngineVerdict
from kvq.check.view import CheckpointView

_ATTN_SCALE = re.compile(r"\.self_attn\.(?:[kv]_proj\.)?([kv])_scale$")


def check_kv_scales(view: CheckpointView, verdict: EngineVerdict, attn_name: str) -> None:
    """`attn_name`: where the engine's attention layer holds the scales (vLLM's `maybe_remap_kv_scale_name`
    in model_loader/weight_utils.py maps `.self_attn.k_scale` to `.self_attn.attn.k_scale`)."""
    engine = verdict.engine
    scheme = view.quant.get("kv_cache_scheme")
    scales = view.kv_scales
    if scheme is not None:
        # vllm compressed_tensors.py CompressedTensorsKVCacheMethod.validate_kv_cache_scheme
        problems = []
        if scheme.get("type") != "float" or scheme.get("num_bits") != 8:
            problems.append(
                f"num_bits={scheme.get('num_bits')}, type={scheme.get('type')} (needs 8-bit float)"
            )
        if scheme.get("strategy") not in ("tensor", "attn_head"):
            problems.append(f"strategy {scheme.get('strategy')!r} (needs tensor or attn_head)")
        if not scheme.get("symmetric", False):
            problems.append("asymmetric scales")
        for problem in problems:
            verdict.add(
                f"{engine}.kv-cache-scheme",
                ERROR,
                "kv_cache_scheme",
                f"{problem}: NotImplementedError at load",
            )
        if not any(n.endswith(".k_scale") for n in scales):
            verdict.add(
                f"{engine}.kv-scales-missing",
                WARNING,
                "kv_cache_scheme",
                "no k_scale tensors: with --kv-cache-dtype fp8_e4m3 every scale falls back to 1.0 "
                "(run kvq calibrate)",
            )
    elif scales:
        verdict.add(
            f"{engine}.kv-scales-unused",
            NOTE,
            scales[0],
            "k/v scales but no kv_cache_scheme: they load only with --kv-cache-dtype fp8_e4m3",
        )
    for name in scales:
        if not _ATTN_SCALE.search(name):
            verdict.add(
                f"{engine}.kv-scale-name",
                WARNING,
                name,
                f"not at `<layer>.self_attn.k_scale`: the engine will not find it (it looks under "
                f"{attn_name})",
            )
    if view.is_mla and any(n.endswith(".v_scale") for n in scales):
        verdict.add(
            f"{engine}.mla-v-scale",
            NOTE,
            "v_scale",
            "MLA caches one latent (kv_c + k_pe) per token and reads k_scale only; v_scale is unused "
            "(vLLM PR #37054)",
        )
