"""Load a checkpoint into a runtime model without decompressing it: INT4 pack-quantized, FP8 block
(float-quantized or `weight_scale_inv`) and dense tensors stay in their stored form.

Model constructors ask a `WeightLoader` for what they need by checkpoint name; the loader notes every
name it hands out and every name it could not find, and `finish()` reports all missing and unexpected
tensors at once. Imports torch, safetensors, kvq.checkpoint and kvq.runtime.layers.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from kvq.checkpoint.model_config import TextModel
from kvq.checkpoint.reader import Checkpoint, block_size
from kvq.errors import KvqError
from kvq.formats.shapes import GROUP_SIZES
from kvq.runtime.config import EngineConfig
from kvq.runtime.distributed.group import TpGroup
from kvq.runtime.distributed.shard import COLS, ROWS, Index, dense_index, fp8_indexes, int4_indexes
from kvq.runtime.kernels import CpuOps, resolve_backend
from kvq.runtime.layers.linear import DENSE, FP8, INT4, Linear, LinearForms, StoredLinear, build_linear
from kvq.runtime.layers.moe import Experts, build_experts
from kvq.runtime.layers.norm import RMSNorm

SUPPORTED_QUANT_METHODS = (None, "fp8", "compressed-tensors")
_MAX_LISTED = 40
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
logger = logging.getLogger("kvq")


class WeightLoader:
    """Hands out tensors of one checkpoint by transformers' name (the checkpoint's, less the language
    model's prefix: Kimi K2.5/K2.6 store `language_model.model.layers.*`), on the engine's device, in the
    runtime's forms. Under tensor parallelism (`tp`) a `split` tensor is read as this rank's slice only
    (`safe_open(...).get_slice`: its byte ranges, never the whole tensor); `read_bytes` counts what was read.
    """

    def __init__(
        self, ckpt: Checkpoint, config: EngineConfig, model: TextModel, tp: TpGroup | None = None
    ) -> None:
        quant_method = ckpt.quantization_config.get("quant_method")
        if quant_method not in SUPPORTED_QUANT_METHODS:
            raise KvqError(
                f"{ckpt.root / 'config.json'}: quantization_config.quant_method {quant_method!r} "
                f"is not supported; kvq loads bf16, fp8 (block) and compressed-tensors checkpoints"
            )
        self.ckpt, self.config, self.prefix = ckpt, config, model.weight_prefix
        self.num_layers = int(model.fields.get("num_hidden_layers") or 0)
        self.dtype, self.device = config.activation_dtype, config.torch_device
        self.tp = tp or TpGroup.single()
        self.cpu_ops = CpuOps.choose(config.cpu_isa)  # the CPU kernels every layer is built for, once
        self.backend = resolve_backend(self.device, config.kernels)  # Triton or torch, once
        self.forms = LinearForms(
            self.dtype,
            self.device,
            self.cpu_ops,
            self.backend,
            config.is_reference,
            config.fp8_weights,
            config.int4_compute,
        )
        self.read_bytes = 0  # stored bytes this rank read: `kvq plan --tp N`'s weights per GPU
        self.block = block_size(ckpt)
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.mismatched: list[str] = []
        self._files = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> WeightLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._files.close()
        self._handles.clear()

    def rms_norm(self, name: str, size: int, eps: float) -> RMSNorm:
        """The RMSNorm of weight `name` `[size]`, run by the engine's CPU kernels."""
        return RMSNorm(self.tensor(name, (size,)), eps, self.cpu_ops)

    # -- plain tensors --------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return self.prefix + name in self.ckpt.tensors

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The stored shape of `name` (from the header: nothing read; marked used), None when absent."""
        info = self.ckpt.tensors.get(self.prefix + name)
        if info is None:
            return None
        self.used.add(self.prefix + name)
        return tuple(info.shape)

    def raw(self, name: str, part: Index | None = None) -> torch.Tensor | None:
        """The stored tensor as it is (CPU), or its slice `part`, marked used; None (and noted missing)
        when absent."""
        stored = self.prefix + name
        info = self.ckpt.tensors.get(stored)
        if info is None:
            self.missing.append(stored)
            return None
        self.used.add(stored)
        handle = self._handles.get(info.file)
        if handle is None:
            handle = self._handles[info.file] = self._files.enter_context(
                safe_open(str(info.file), framework="pt")
            )
        if part is None:
            t = handle.get_tensor(stored)  # type: ignore[attr-defined]
        else:
            t = handle.get_slice(stored)[part]  # type: ignore[attr-defined]
        self.read_bytes += t.numel() * t.element_size()
        _check_finite(stored, t, self.ckpt.root)
        return t

    def tensor(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None, split: str | None = None
    ) -> torch.Tensor:
        """A float tensor (norm, bias, embedding, router) in `dtype` (default: activations) on the device;
        with `split`, this rank's rows (the embedding's vocabulary, a column-parallel bias)."""
        split = None if self.tp.size == 1 else split
        local = shape if split is None else (shape[0] // self.tp.size, *shape[1:])
        found = self.shape(name)
        if found is None or found != shape:
            self.raw(name) if found is None else self._check_shape(name, found, shape)  # noted
            return torch.zeros(local, dtype=dtype or self.dtype, device=self.device)
        t = self.raw(name, None if split is None else dense_index(self.tp, split, shape, name))
        assert t is not None
        return t.to(device=self.device, dtype=dtype or self.dtype)

    def optional(self, name: str) -> torch.Tensor | None:
        """A tensor that may be absent (k_scale / v_scale): None without noting it missing."""
        return self.raw(name) if self.has(name) else None

    # -- linear layers --------------------------------------------------------------------------------
    def stored_linear(
        self, prefix: str, shape: tuple[int, int], bias: bool = False, split: str | None = None
    ) -> StoredLinear:
        """The stored form of Linear `prefix` with weight shape (out, in) = `shape`; with `split` (ROWS:
        column-parallel, COLS: row-parallel) this rank's part of it under tensor parallelism. A
        row-parallel bias is added once, by rank 0, before the all-reduce."""
        split = None if self.tp.size == 1 else split
        local = _local_shape(shape, split, self.tp.size)
        bias_t = None
        if bias and (split != COLS or self.tp.is_leader):
            bias_t = self.tensor(f"{prefix}.bias", (shape[0],), split=split if split == ROWS else None)
        if self.has(f"{prefix}.weight_packed"):
            return self._int4(prefix, shape, bias_t, split)
        found = self.shape(f"{prefix}.weight")
        if found is None:
            self.raw(f"{prefix}.weight")  # noted missing
            return self._absent(local)
        if found != shape:
            self._check_shape(f"{prefix}.weight", found, shape)
            return self._absent(local)
        scale_name = next(
            (f"{prefix}.{s}" for s in ("weight_scale_inv", "weight_scale") if self.has(f"{prefix}.{s}")),
            None,
        )
        is_fp8 = self.ckpt.tensors[self.prefix + f"{prefix}.weight"].dtype.startswith("F8")
        if not is_fp8:
            part = None if split is None else dense_index(self.tp, split, shape, f"{prefix}.weight")
            weight = self.raw(f"{prefix}.weight", part)
            assert weight is not None
            return StoredLinear(DENSE, {"weight": weight}, bias=bias_t, names=[f"{prefix}.weight"])
        if scale_name is None:
            self.raw(f"{prefix}.weight_scale")  # noted missing
            return self._absent(local)
        weight_part: Index | None = None
        scale_part: Index | None = None
        if split is not None:
            scale_shape = self.shape(scale_name) or ()
            weight_part, scale_part = fp8_indexes(
                self.tp, split, shape, scale_shape, self.block, prefix, scale_name
            )
        weight, scale = self.raw(f"{prefix}.weight", weight_part), self.raw(scale_name, scale_part)
        assert weight is not None and scale is not None
        return StoredLinear(
            FP8,
            {"weight": weight, "weight_scale": scale.float()},
            self.block,
            bias=bias_t,
            names=[f"{prefix}.weight", scale_name],
        )

    def linear(
        self,
        prefixes: list[str],
        shapes: list[tuple[int, int]],
        bias: bool = False,
        split: str | list[str | None] | None = None,
    ) -> Linear:
        """The runtime Linear of `prefixes` stacked by rows (q/k/v, gate/up), merged where the forms allow;
        `split` (one for all, or one per part) as `stored_linear`'s."""
        splits = split if isinstance(split, list) else [split] * len(prefixes)
        parts = [
            self.stored_linear(p, s, bias, sp) for p, s, sp in zip(prefixes, shapes, splits, strict=True)
        ]
        return build_linear(parts, self.forms)

    def experts(self, prefix: str, num_experts: int, hidden: int, intermediate: int) -> Experts:
        """Routed experts `{prefix}.{e}.{gate,up,down}_proj` (per-expert 2-D tensors on disk); under tensor
        parallelism each rank holds every expert's share of the intermediate dimension."""
        gate_up = [
            [
                self.stored_linear(f"{prefix}.{e}.{p}_proj", (intermediate, hidden), split=ROWS)
                for p in ("gate", "up")
            ]
            for e in range(num_experts)
        ]
        down = [
            self.stored_linear(f"{prefix}.{e}.down_proj", (hidden, intermediate), split=COLS)
            for e in range(num_experts)
        ]
        return build_experts(gate_up, down, self.forms)

    def _int4(
        self, prefix: str, shape: tuple[int, int], bias: torch.Tensor | None, split: str | None
    ) -> StoredLinear:
        local = _local_shape(shape, split, self.tp.size)
        packed_shape, scale_shape = (
            self.shape(f"{prefix}.weight_packed"),
            self.shape(f"{prefix}.weight_scale"),
        )
        stored_shape = self.raw(f"{prefix}.weight_shape") if self.has(f"{prefix}.weight_shape") else None
        if packed_shape is None or scale_shape is None:
            self.raw(f"{prefix}.weight_packed" if packed_shape is None else f"{prefix}.weight_scale")
            return self._absent(local)
        logical = (
            tuple(stored_shape.tolist())
            if stored_shape is not None
            else (packed_shape[0], packed_shape[1] * 8)
        )
        self._check_shape(f"{prefix}.weight_shape", logical, shape)
        if packed_shape != (shape[0], shape[1] // 8) or len(scale_shape) != 2 or shape[1] % scale_shape[1]:
            self.mismatched.append(
                f"{prefix}.weight_packed {packed_shape} / weight_scale "
                f"{scale_shape} do not fit a weight of shape {shape}"
            )
            return self._absent(local)
        group_size = shape[1] // scale_shape[1]
        if group_size not in GROUP_SIZES:
            self.mismatched.append(
                f"{prefix}.weight_scale implies group size {group_size}; kvq runs {GROUP_SIZES}"
            )
            return self._absent(local)
        parts: tuple[Index | None, Index | None] = (None, None)
        if split is not None:
            parts = int4_indexes(self.tp, split, shape, scale_shape[1], prefix)
        packed = self.raw(f"{prefix}.weight_packed", parts[0])
        scale = self.raw(f"{prefix}.weight_scale", parts[1])
        assert packed is not None and scale is not None
        names = [f"{prefix}.weight_packed", f"{prefix}.weight_scale"]
        return StoredLinear(
            INT4,
            {"weight_packed": packed, "weight_scale": scale},
            group_size=group_size,
            bias=bias,
            names=names,
        )

    def _absent(self, shape: tuple[int, int]) -> StoredLinear:
        """A stand-in for a Linear that could not be loaded, so building goes on and `finish` reports all."""
        return StoredLinear(DENSE, {"weight": torch.zeros(shape, dtype=self.dtype)})

    def _check_shape(self, name: str, found: tuple[int, ...], expected: tuple[int, ...]) -> None:
        if found != expected:
            self.mismatched.append(f"{name} has shape {found}, expected {expected}")

    # -- the verdict ----------------------------------------------------------------------------------
    def not_loaded(self) -> tuple[list[str], list[str], list[str]]:
        """(Tensors of MTP layers, stored past the last decoder layer; tensors outside the language model,
        e.g. a vision tower; the other tensors no layer asked for, which are an error)."""
        mtp: list[str] = []
        foreign: list[str] = []
        unexpected: list[str] = []
        for name in sorted(set(self.ckpt.tensors) - self.used):
            layer = _LAYER.match(name[len(self.prefix) :]) if name.startswith(self.prefix) else None
            if not name.startswith(self.prefix):
                foreign.append(name)
            elif layer is not None and int(layer[1]) >= self.num_layers:
                mtp.append(name)
            else:
                unexpected.append(name)
        return mtp, foreign, unexpected

    def finish(self) -> None:
        """Raise one `KvqError` naming every missing, unexpected and mis-shaped tensor, if there are any."""
        mtp, foreign, unexpected = self.not_loaded()
        if mtp:
            logger.warning(
                "note: %s: the %d tensors of its MTP layers (from model.layers.%d) are not loaded: pass "
                "--speculative mtp to draft tokens with them",
                self.ckpt.root,
                len(mtp),
                self.num_layers,
            )
        if foreign:
            logger.warning(
                "note: %s: %d tensors outside the language model are not loaded (e.g. %s)",
                self.ckpt.root,
                len(foreign),
                foreign[0],
            )
        problems = []
        for what, names in (
            ("missing", sorted(set(self.missing))),
            ("unexpected", unexpected),
            ("with the wrong shape", self.mismatched),
        ):
            if names:
                listed = ", ".join(names[:_MAX_LISTED])
                more = f" (and {len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
                problems.append(f"{len(names)} tensor(s) {what}: {listed}{more}")
        if problems:
            raise KvqError(
                f"{self.ckpt.root}: does not match the {self.ckpt.config.get('model_type')} model: "
                + "; ".join(problems)
                + ". Check that the checkpoint is complete and its config.json describes it"
            )


def _local_shape(shape: tuple[int, int], split: str | None, tp: int) -> tuple[int, int]:
    """A rank's part of a weight `[N, K]`: N / tp rows (ROWS), K / tp columns (COLS), or all of it."""
    if split == ROWS:
        return shape[0] // tp, shape[1]
    if split == COLS:
        return shape[0], shape[1] // tp
    return shape


def _check_finite(name: str, t: torch.Tensor, root: object) -> None:
    """`KvqError` naming the tensor when a float tensor read holds a NaN or an infinity (one pass over bytes
    just read: a corrupt checkpoint stops at load, not as NaN logits mid-request)."""
    if not t.is_floating_point():
        return
    if t.dtype == torch.float8_e4m3fn:  # no infinities: NaN is S.1111.111
        is_bad = (t.view(torch.uint8) & 0x7F) == 0x7F
    elif t.element_size() == 1:  # other 8-bit floats: not read by kvq
        return
    else:
        is_bad = ~torch.isfinite(t)
    if bool(is_bad.any()):
        where = int(is_bad.flatten().nonzero()[0])
        raise KvqError(
            f"{root}: tensor {name} holds a NaN or an infinity (element {where}); the checkpoint is corrupt: "
            "re-download or re-export it"
        )
