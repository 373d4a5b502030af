"""Recipes: YAML in llm-compressor's schema (one `QuantizationModifier`) saying which Linears become INT4.

kvq reads the data-free subset of that schema, strictly: one stage, one `QuantizationModifier` with
`targets` + `scheme: W4A16`, or one `config_groups` group of symmetric INT4 group weights; `ignore`.
A `GPTQModifier` takes the same keys plus GPTQ's `block_size`, `dampening_frac` and `actorder`
(`kvq compress --method gptq`), and its weights may name `observer: mse` (the group scales GPTQ keeps) with
`observer_kwargs` (that search's settings).
Matching is compressed-tensors': a target is `Linear` (every Linear weight), an exact module name, or
`re:<regex>` applied with `re.match` to the module name. The same file drives llm-compressor unchanged.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import yaml

from kvq.compress.gptq_settings import RECIPE_KEYS, GptqSettings
from kvq.errors import KvqError
from kvq.formats.shapes import GROUP_SIZES

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"  # package data: installed with kvq
_MODIFIER = "QuantizationModifier"
_GPTQ_MODIFIER = "GPTQModifier"
_MODIFIER_KEYS = {"targets", "scheme", "config_groups", "ignore"}
_GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
# Data-free round-to-nearest: any min/max observer sees the whole weight once, so they agree.
_OBSERVERS = {None, "minmax", "static_minmax", "memoryless_minmax"}
_GPTQ_OBSERVERS = {"mse"}  # llm-compressor's MSE scale search (kvq.gptq.observer), GPTQModifier only
_WEIGHTS = {
    "num_bits": 4,
    "type": "int",
    "symmetric": True,
    "strategy": "group",
    "dynamic": False,
    "actorder": None,
    "observer": None,
    "observer_kwargs": None,
    "group_size": None,
}


@dataclass(frozen=True)
class Recipe:
    """A validated INT4 recipe: which modules to quantize, with which group size."""

    name: str
    targets: tuple[str, ...]
    ignore: tuple[str, ...]
    group_size: int
    path: Path  # the recipe file; sha256 of its bytes: what `identity` and the manifest record
    sha256: str
    gptq: GptqSettings | None = None  # set by a GPTQModifier recipe

    def matches(self, *names: str) -> bool:
        """True if the Linear known by `names` is targeted and not ignored (compressed-tensors semantics).

        `names`: its stored name and, in a multimodal checkpoint, its name without the language-model
        prefix, so `lm_head` in `ignore` also covers Kimi K2.5's `language_model.lm_head`."""
        return any(matches_target(n, t) for n in names for t in self.targets) and not any(
            matches_target(n, i) for n in names for i in self.ignore
        )

    def with_group_size(self, group_size: int | None) -> Recipe:
        if group_size is None or group_size == self.group_size:
            return self
        _check_group_size(group_size, f"--group-size {group_size}")
        return replace(self, group_size=group_size)

    def weights_args(self) -> dict:
        """The compressed-tensors `QuantizationArgs` fields of the INT4 weights."""
        return {
            "num_bits": 4,
            "type": "int",
            "symmetric": True,
            "strategy": "group",
            "group_size": self.group_size,
            "dynamic": False,
        }

    def quantization_config(self):
        """The recipe as a compressed-tensors `QuantizationConfig` (what llm-compressor builds from it)."""
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

        observer = (
            {"observer": self.gptq.observer, "observer_kwargs": self.gptq.search}
            if self.gptq and self.gptq.observer != "minmax"
            else {}
        )
        scheme = QuantizationScheme(
            targets=list(self.targets), weights=QuantizationArgs(**self.weights_args(), **observer)
        )
        return QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(self.ignore))

    def identity(self) -> dict:
        """What distinguishes this recipe in a job: its name, file content hash and group size."""
        return {"name": self.name, "sha256": self.sha256, "group_size": self.group_size}


def matches_target(module: str, target: str) -> bool:
    """compressed-tensors' name matching: `Linear` (any Linear), `re:<regex>` (re.match), or an exact name."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return _regex(target).match(module) is not None
    return module == target


@cache
def _regex(target: str) -> re.Pattern[str]:
    return re.compile(target.removeprefix("re:"))


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_recipe_path(recipe: str) -> Path:
    """A recipe name from `kvq/recipes/` (e.g. `w4a16-experts`) or a path to a YAML file."""
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise KvqError(
                f"{path}: no such recipe file; pass an existing YAML file or one of: "
                f"{', '.join(available_recipes())}"
            )
        return path
    named = RECIPES_DIR / f"{recipe}.yaml"
    if not named.is_file():
        raise KvqError(
            f"recipe {recipe!r} is not known; use one of {', '.join(available_recipes())} "
            f"(in {RECIPES_DIR}) or pass a path to a YAML recipe"
        )
    return named


def load_recipe(recipe: str, group_size: int | None = None) -> Recipe:
    """Load and validate a recipe by name or path; `group_size` overrides the recipe's."""
    path = resolve_recipe_path(recipe)
    raw = path.read_bytes()
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise KvqError(f"{path}: not valid YAML ({e}); fix the recipe file") from e
    targets, ignore, size, gptq = _parse(path, data)
    sha256 = hashlib.sha256(raw).hexdigest()
    loaded = Recipe(path.stem, targets, ignore, size, path=path, sha256=sha256, gptq=gptq)
    return loaded.with_group_size(group_size)


def _fail(path: Path, where: str, problem: str) -> KvqError:
    return KvqError(f"{path}: {where}: {problem}")


def _one(path: Path, where: str, mapping: object, what: str) -> tuple[str, object]:
    if not isinstance(mapping, dict) or len(mapping) != 1:
        found = list(mapping) if isinstance(mapping, dict) else type(mapping).__name__
        raise _fail(path, where, f"expected exactly one {what}, found {found}")
    return next(iter(mapping.items()))


def _unknown_keys(path: Path, where: str, mapping: dict, allowed: set[str]) -> None:
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise _fail(
            path,
            where,
            f"unknown recipe key(s) {', '.join(unknown)}; kvq compress (INT4 weights) "
            f"accepts only {', '.join(sorted(allowed))} here: remove them",
        )


def _parse(path: Path, data: object) -> tuple[tuple[str, ...], tuple[str, ...], int, GptqSettings | None]:
    stage_name, stage = _one(path, "top level", data, "stage (e.g. `quant_stage:`)")
    group_name, modifiers = _one(path, stage_name, stage, "modifier group (e.g. `quant_modifiers:`)")
    modifier_name, modifier = _one(path, f"{stage_name}.{group_name}", modifiers, f"modifier ({_MODIFIER})")
    where = f"{stage_name}.{group_name}.{modifier_name}"
    if modifier_name not in (_MODIFIER, _GPTQ_MODIFIER):
        raise _fail(
            path, where, f"kvq compress runs only {_MODIFIER} or {_GPTQ_MODIFIER}, not {modifier_name}"
        )
    if not isinstance(modifier, dict):
        raise _fail(path, where, f"expected a mapping of {modifier_name} fields")
    is_gptq = modifier_name == _GPTQ_MODIFIER
    _unknown_keys(path, where, modifier, _MODIFIER_KEYS | (set(RECIPE_KEYS) if is_gptq else set()))
    ignore = tuple(_string_list(path, f"{where}.ignore", modifier.get("ignore", [])))
    if ("scheme" in modifier) == ("config_groups" in modifier):
        raise _fail(path, where, "set exactly one of `scheme` (with `targets`) and `config_groups`")
    if "scheme" in modifier:
        if modifier["scheme"] != "W4A16":
            raise _fail(
                path,
                f"{where}.scheme",
                f"{modifier['scheme']!r} is not supported; use W4A16 "
                "or a config_groups entry with 4-bit symmetric group weights",
            )
        targets = tuple(_string_list(path, f"{where}.targets", modifier.get("targets", ["Linear"])))
        gptq = GptqSettings.from_recipe(modifier, f"{path}: {where}") if is_gptq else None
        return targets, ignore, 128, gptq
    if "targets" in modifier:
        raise _fail(path, f"{where}.targets", "with config_groups, put targets inside the group")
    group_key, group = _one(path, f"{where}.config_groups", modifier["config_groups"], "config group")
    group_where = f"{where}.config_groups.{group_key}"
    targets, size, observer, observer_kwargs = _parse_group(path, group_where, group, is_gptq)
    gptq = (
        GptqSettings.from_recipe(modifier, f"{path}: {where}", observer, observer_kwargs) if is_gptq else None
    )
    return targets, ignore, size, gptq


def _parse_group(
    path: Path, where: str, group: object, is_gptq: bool
) -> tuple[tuple[str, ...], int, str, dict]:
    """(targets, group size, observer: minmax or mse, its observer_kwargs) of one config group."""
    if not isinstance(group, dict):
        raise _fail(path, where, "expected a mapping with targets and weights")
    _unknown_keys(path, where, group, _GROUP_KEYS)
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise _fail(
                path,
                f"{where}.{key}",
                "activation quantization needs calibration data; "
                "kvq compress writes weight-only (W4A16) checkpoints: remove it",
            )
    if group.get("format", "pack-quantized") != "pack-quantized":
        raise _fail(path, f"{where}.format", f"{group['format']!r}: kvq writes pack-quantized")
    targets = tuple(_string_list(path, f"{where}.targets", group.get("targets")))
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _fail(
            path, f"{where}.weights", "expected a mapping (num_bits, type, symmetric, strategy, group_size)"
        )
    _unknown_keys(path, f"{where}.weights", weights, set(_WEIGHTS))
    for key, expected in _WEIGHTS.items():
        if key in ("group_size", "observer", "observer_kwargs") or key not in weights:
            continue
        if weights[key] != expected:
            raise _fail(
                path,
                f"{where}.weights.{key}",
                f"{weights[key]!r} is not supported; kvq writes "
                f"{key}: {expected} (symmetric INT4 group weights)",
            )
    observer = weights.get("observer")
    if observer in _GPTQ_OBSERVERS and not is_gptq:
        raise _fail(
            path,
            f"{where}.weights.observer",
            f"{observer!r} is supported only in a {_GPTQ_MODIFIER} (the scales GPTQ keeps); kvq's "
            f"{_MODIFIER} rounds to nearest with a min/max scale: use minmax, or a {_GPTQ_MODIFIER}",
        )
    if observer not in _OBSERVERS | (_GPTQ_OBSERVERS if is_gptq else set()):
        supported = "minmax" + (" or mse" if is_gptq else "")
        raise _fail(path, f"{where}.weights.observer", f"{observer!r} is not supported; use {supported}")
    observer_kwargs = weights.get("observer_kwargs") or {}
    if not isinstance(observer_kwargs, dict):
        found = f"expected a mapping, found {observer_kwargs!r}"
        raise _fail(path, f"{where}.weights.observer_kwargs", found)
    if observer_kwargs and observer not in _GPTQ_OBSERVERS:
        raise _fail(
            path,
            f"{where}.weights.observer_kwargs",
            f"settings of the mse observer (in a {_GPTQ_MODIFIER}); {observer or 'minmax'!r} takes none: "
            "remove them or set observer: mse",
        )
    size = weights.get("group_size", 128)
    _check_group_size(size, f"{path}: {where}.weights.group_size")
    return targets, size, "minmax" if observer in _OBSERVERS else str(observer), observer_kwargs


def _check_group_size(size: object, where: str) -> None:
    if size not in GROUP_SIZES:
        raise KvqError(
            f"{where}: group size {size!r} is not supported; use one of {', '.join(map(str, GROUP_SIZES))}"
        )


def _string_list(path: Path, where: str, value: object) -> list[str]:
    is_empty_targets = value == [] and where.endswith("targets")
    if not isinstance(value, list) or is_empty_targets or not all(isinstance(v, str) for v in value):
        raise _fail(path, where, f"expected a list of module names or re: patterns, found {value!r}")
    for pattern in (v for v in value if v.startswith("re:")):
        try:
            _regex(pattern)
        except re.error as e:
            raise _fail(path, where, f"{pattern!r} is not a valid regular expression ({e})") from e
    return value
