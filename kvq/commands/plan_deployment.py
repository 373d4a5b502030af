"""`kvq plan --config FILE`: a serving config's deployment (GPUs, memory, KV dtype, context) checked
against the plan's serving memory: do the weights fit, and does the KV pool hold a full context in the
configured KV-cache dtype. Imports typer and kvq (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from kvq.commands.field_options import given
from kvq.compress.serving_memory import KV_CACHE_DTYPES, ServingMemory
from kvq.config_file import ConfigFile, Deployment, load_config
from kvq.errors import KvqError


@dataclass(frozen=True)
class DeploymentCheck:
    config: ConfigFile
    deployment: Deployment
    kv_cache_dtype: str
    max_model_len: int

    @classmethod
    def read(cls, path: Path) -> DeploymentCheck:
        config = load_config(path)
        if config.deployment is None:
            raise KvqError(f"{path}: no deployment section; kvq plan --config reads tp and gpu_mem from it")
        kv = config.engine.get("kv_cache_dtype")
        if kv not in KV_CACHE_DTYPES:
            raise KvqError(
                f"{path}: engine.kv_cache_dtype is {kv!r}; a deployment names its KV-cache dtype, one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        max_model_len = config.engine.get("max_model_len")
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise KvqError(
                f"{path}: engine.max_model_len is {max_model_len!r}; a deployment sets its context"
            )
        return cls(config, config.deployment, kv, max_model_len)

    def settings(
        self, ctx: typer.Context, tp: int | None, gpu_mem: str | None, mem_fraction: float, recipe: str | None
    ) -> tuple[int, str, float, str | None]:
        """(tp, gpu_mem, mem_fraction, recipe): the deployment's, with the flags given over them."""
        d = self.deployment
        file = {"tp": d.tp, "gpu_mem": d.gpu_mem, "mem_fraction": d.mem_fraction, "recipe": d.recipe}
        merged = {**file, **given(ctx, {name: ctx.params[name] for name in file})}
        return merged["tp"], merged["gpu_mem"], merged["mem_fraction"], merged["recipe"]

    def verdict(self, memory: ServingMemory) -> dict:
        """Whether the deployment fits: the weights leave a KV budget and it holds one full context in
        the configured KV-cache dtype."""
        kv = next(k for k in memory.kv if k.kv_cache_dtype == self.kv_cache_dtype)
        fits = memory.kv_budget_bytes > 0 and kv.tokens >= self.max_model_len
        where = f"{memory.tp} x {self.deployment.gpu or 'GPU'} ({self.config.path.name})"
        summary = (
            f"deployment {where}: {'fits' if fits else 'does NOT fit'}: {kv.tokens} KV tokens in "
            f"{self.kv_cache_dtype} per GPU for a {self.max_model_len}-token context "
            f"({kv.tokens // self.max_model_len} full contexts at once)"
        )
        return {
            "config": str(self.config.path),
            "fits": fits,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_tokens": kv.tokens,
            "max_model_len": self.max_model_len,
            "full_contexts": kv.tokens // self.max_model_len,
            "summary": summary,
        }
