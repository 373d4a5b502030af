"""GPTQ's own settings, as llm-compressor's `GPTQModifier` takes them in a recipe (its defaults too).

`block_size` (columns updated together), `dampening_frac` (fraction of the mean Hessian diagonal added
to it), `actorder` (`static`, llm-compressor's alias of `weight`: columns in descending Hessian-diagonal
order, scales kept per original group, so servers need no `g_idx`; or none); and the observer of the
group scales GPTQ keeps (the recipe weights' `observer`: `minmax`, or llm-compressor's `mse` search).
Standard library only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvq.errors import KvqError

ACTORDERS = ("static", None)
OBSERVERS = ("minmax", "mse")  # kvq.gptq.observer's (this module imports no torch)
_ACTORDER_ALIASES = {"static": "static", "weight": "static", None: None, False: None}
RECIPE_KEYS = ("block_size", "dampening_frac", "actorder")


@dataclass(frozen=True)
class GptqSettings:
    block_size: int = 128
    dampening_frac: float = 0.01
    actorder: str | None = "static"
    observer: str = "minmax"

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise KvqError(f"GPTQ block_size must be a positive integer, got {self.block_size!r}")
        frac = self.dampening_frac
        if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 <= frac < 1:
            raise KvqError(f"GPTQ dampening_frac must be a number in [0, 1), got {frac!r}")
        if self.actorder not in ACTORDERS:
            raise KvqError(f"GPTQ actorder must be static or none, got {self.actorder!r}")
        if self.observer not in OBSERVERS:
            raise KvqError(f"GPTQ observer must be one of {', '.join(OBSERVERS)}, got {self.observer!r}")

    @classmethod
    def from_recipe(cls, fields: dict, where: str, observer: str = "minmax") -> GptqSettings:
        """The settings a `GPTQModifier` mapping sets (missing keys keep llm-compressor's defaults), with
        the `observer` its weights name."""
        actorder = fields.get("actorder", "static")
        if isinstance(actorder, str):
            actorder = actorder.lower()
        if actorder not in _ACTORDER_ALIASES:
            raise KvqError(
                f"{where}.actorder: {fields['actorder']!r} is not supported; use static (columns in "
                "activation order, no g_idx needed by servers) or null"
            )
        try:
            return cls(
                block_size=fields.get("block_size", cls.block_size),
                dampening_frac=fields.get("dampening_frac", cls.dampening_frac),
                actorder=_ACTORDER_ALIASES[actorder],
                observer=observer,
            )
        except KvqError as e:
            raise KvqError(f"{where}: {e}; fix the recipe") from e

    def record(self) -> dict:
        return asdict(self)
