"""scripts/gpu_check.sh runs on a GPU machine whose Python has torch, triton, transformers and pytest but
none of compressed-tensors, llm-compressor, gguf or gensim (the device's package list): the kernel tests,
the MLA engine test and the kernel benchmark must import there, or the GPU session is lost to an
ImportError. Test files that need those packages are named in the script's `--ignore` list, and only
there."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ABSENT_ON_THE_GPU_MACHINE = ("compressed_tensors", "llmcompressor", "gguf", "gensim")
MLA_ENGINE_TESTS = "tests/runtime/test_gpu_mla_engine.py"  # the script's engine step
IGNORED = re.findall(r"--ignore=(\S+?)[)\s]", (ROOT / "scripts" / "gpu_check.sh").read_text())


def test_kernel_tests_and_bench_import_without_the_cpu_only_packages() -> None:
    block = "".join(f"sys.modules[{name!r}] = None\n" for name in ABSENT_ON_THE_GPU_MACHINE)  # import fails
    code = (
        f"import sys\n{block}"
        "import kvq.bench.kernels\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '--collect-only', '-p', 'no:cacheprovider', '-m', 'gpu or not gpu',"
        f" *{[f'--ignore={path}' for path in IGNORED]!r}, 'tests/runtime/kernels', {MLA_ENGINE_TESTS!r}]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]  # 2: a collection error
    assert IGNORED == ["tests/runtime/kernels/test_w4a16_layout.py"]
    assert MLA_ENGINE_TESTS in (ROOT / "scripts" / "gpu_check.sh").read_text()


def test_the_ignored_files_do_need_the_cpu_only_packages() -> None:
    """An --ignore entry is there for a reason: without the packages the file cannot even be collected."""
    block = "".join(f"sys.modules[{name!r}] = None\n" for name in ABSENT_ON_THE_GPU_MACHINE)
    code = (
        f"import sys\n{block}import pytest\nsys.exit(pytest.main(['-q', '--collect-only', *{IGNORED!r}]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stdout[-3000:]  # interrupted: errors during collection
