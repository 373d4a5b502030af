"""Input Hessians of Linear layers, accumulated in fp32 from the inputs a forward hands them.

`HessianSum.add(x)` is llm-compressor's `accumulate_hessian` for a Linear, operation for operation:
`H += (sqrt(2) X^T)(sqrt(2) X^T)^T` over the rows of `x` `[..., in]`, counting one sample per leading
batch entry (a 2-D input counts one); `normalized()` is `H / num_samples`. GPTQ is invariant to the
Hessian's scale, so the normalization only matters for bit-equality with llm-compressor.
`LinearHessians` hooks a decoder layer's targeted `nn.Linear`s; Linears fed the same input tensor in a
forward (q/k/v, gate/up) share one sum. For GPTAQ (`asymmetric`) a forward of the same sample through
the full-precision model comes first (`capturing()`): its inputs X_fp are held, and the next forward
also sums `2 (X_fp - X)^T X` (`HessianSum.cross`, the reference implementation's `dXXT`). Imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class HessianSum:
    """Running `sum 2 X^T X` `[in, in]` fp32, with the sample count and the number of rows seen."""

    def __init__(self, in_features: int, asymmetric: bool = False) -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.cross = torch.zeros_like(self.sum) if asymmetric else None  # sum 2 (X_fp - X)^T X
        self.num_samples = 0
        self.num_tokens = 0

    def add(self, x: torch.Tensor, x_fp: torch.Tensor | None = None) -> None:
        inp = x.unsqueeze(0) if x.ndim == 2 else x
        self.num_samples += inp.shape[0]
        inp = inp.reshape(-1, inp.shape[-1])
        self.num_tokens += inp.shape[0]
        inp = inp.t()
        inp = math.sqrt(2) * inp.to(dtype=torch.float32)
        self.sum += inp.matmul(inp.t())
        if self.cross is not None:
            assert x_fp is not None and x_fp.shape == x.shape, "GPTAQ: no full-precision input for this one"
            fp = math.sqrt(2) * x_fp.reshape(-1, x_fp.shape[-1]).t().to(dtype=torch.float32)
            self.cross += (fp - inp).matmul(inp.t())

    def normalized(self) -> torch.Tensor:
        return self.sum / torch.tensor(float(self.num_samples))

    def normalized_cross(self) -> torch.Tensor | None:
        """GPTAQ's `2 (X_fp - X)^T X / samples` (None for GPTQ)."""
        return None if self.cross is None else self.cross / torch.tensor(float(self.num_samples))


class LinearHessians:
    """Hessians of the named `nn.Linear` submodules of one layer, filled while `hooked()` is active.

    The first forward decides which modules share an input (the same tensor object passed to them);
    a shared sum is kept once, under the first such module's name (`leader`).
    """

    def __init__(self, layer: nn.Module, names: list[str], asymmetric: bool = False) -> None:
        self.layer = layer
        self.names = names
        self.asymmetric = asymmetric
        self.sums: dict[str, HessianSum] = {}
        self.leader: dict[str, str] = {}
        self._inputs: list[tuple[torch.Tensor, str]] = []  # the current forward's inputs, by leader
        self._fp_inputs: dict[str, torch.Tensor] = {}  # GPTAQ: this sample's full-precision inputs

    def hessian(self, name: str) -> HessianSum:
        return self.sums[self.leader[name]]

    def new_forward(self) -> None:
        """Before each sample's forward (a hook on the layer): inputs are matched within one forward."""
        self._inputs = []

    @contextmanager
    def hooked(self) -> Iterator[None]:
        handles = [
            self.layer.get_submodule(name).register_forward_hook(self._hook(name)) for name in self.names
        ]
        handles.append(self.layer.register_forward_pre_hook(lambda *_: self.new_forward()))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._inputs = []

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """GPTAQ: hold each module's input of a full-precision forward of the sample `hooked()` sees next."""

        def capture(name: str):  # noqa: ANN202 (a forward hook)
            def hook(_module: nn.Module, args: tuple[torch.Tensor, ...], _output: torch.Tensor) -> None:
                self._fp_inputs[name] = args[0]

            return hook

        handles = [self.layer.get_submodule(name).register_forward_hook(capture(name)) for name in self.names]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, name: str):  # noqa: ANN202 (a forward hook)
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], _output: torch.Tensor) -> None:
            x = args[0]
            x_fp = self._fp_inputs.pop(name, None)
            leader = self.leader.get(name)
            if leader is None:
                leader = next((lead for seen, lead in self._inputs if seen is x), name)
                self.leader[name] = leader
            if leader != name:
                return
            if name not in self.sums:
                self.sums[name] = HessianSum(x.shape[-1], self.asymmetric)
            self._inputs.append((x, name))
            self.sums[name].add(x, x_fp)

        return hook
