"""GPTQ's own settings, as llm-compressor's `GPTQModifier` takes them in a recipe (its defaults too): parsed
with the recipe (`kvq.compress.recipe`), run by `kvq.gptq`.

`block_size` (columns updated together), `dampening_frac` (fraction of the mean Hessian diagonal added
to it), `actorder` (`static`, llm-compressor's alias of `weight`: columns in descending Hessian-diagonal
order, scales kept per original group, so servers need no `g_idx`; or none); and the observer of the
group scales GPTQ keeps (the recipe weights' `observer`: `minmax`, or llm-compressor's `mse` search, with
the `observer_kwargs` that change its search: `MSE_KWARGS`). Standard library only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvq.errors import KvqError

ACTORDERS = ("static", None)
OBSERVERS = ("minmax", "mse")  # kvq.gptq.observer's (this module imports no torch)
# llm-compressor's MSE observer's search settings and their defaults (`kvq.gptq.observer`)
MSE_KWARGS = {"maxshrink": 0.20, "grid": 100.0, "norm": 2.4, "patience": 5, "expand": 1.0}
# observer_kwargs llm-compressor takes that cannot change a weight's scales here: the moving average of
# one observation is that observation; the buffer tunes only its CUDA Triton search (kvq runs the eager one)
MSE_INERT_KWARGS = ("averaging_constant", "triton_error_buffer")
_ACTORDER_ALIASES = {"static": "static", "weight": "static", None: None, False: None}
RECIPE_KEYS = ("block_size", "dampening_frac", "actorder")


@dataclass(frozen=True)
class GptqSettings:
    block_size: int = 128
    dampening_frac: float = 0.01
    actorder: str | None = "static"
    observer: str = "minmax"
    observer_kwargs: tuple[tuple[str, float], ...] = ()  # sorted (name, value) pairs of MSE_KWARGS

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
        for name, value in self.observer_kwargs:
            _check_mse_kwarg(name, value)

    @property
    def search(self) -> dict[str, float]:
        """The observer settings the recipe sets (keyword arguments of its search; the rest default)."""
        return dict(self.observer_kwargs)

    @classmethod
    def from_recipe(
        cls, fields: dict, where: str, observer: str = "minmax", observer_kwargs: dict | None = None
    ) -> GptqSettings:
        """The settings a `GPTQModifier` mapping sets (missing keys keep llm-compressor's defaults), with
        the `observer` (and `observer_kwargs`) its weights name."""
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
                observer_kwargs=tuple(
                    sorted(
                        ((k, v) for k, v in (observer_kwargs or {}).items() if k not in MSE_INERT_KWARGS),
                        key=lambda item: str(item[0]),
                    )
                ),
            )
        except KvqError as e:
            raise KvqError(f"{where}: {e}; fix the recipe") from e

    def record(self) -> dict:
        """For the job identity and the manifest (observer_kwargs only when set: older jobs resume)."""
        record = asdict(self)
        if observer_kwargs := record.pop("observer_kwargs"):
            record["observer_kwargs"] = dict(observer_kwargs)
        return record

    def modifier_fields(self) -> dict:
        """The `GPTQModifier` fields (RECIPE_KEYS) as llm-compressor takes them."""
        return {key: getattr(self, key) for key in RECIPE_KEYS}


def _check_mse_kwarg(name: str, value: object) -> None:
    if name not in MSE_KWARGS:
        accepted = ", ".join([*MSE_KWARGS, *MSE_INERT_KWARGS])
        raise KvqError(f"observer_kwargs: {name!r} is not a setting of the mse observer; use {accepted}")
    rules = {
        "maxshrink": ("in (0, 1]", lambda v: 0 < v <= 1),
        "expand": (">= 1", lambda v: v >= 1),
        "patience": ("a positive integer", lambda v: isinstance(v, int) and v >= 1),
    }
    what, is_ok = rules.get(name, ("a positive number", lambda v: v > 0))
    if isinstance(value, bool) or not isinstance(value, int | float) or not is_ok(value):
        raise KvqError(f"observer_kwargs.{name} must be {what}, got {value!r}")
