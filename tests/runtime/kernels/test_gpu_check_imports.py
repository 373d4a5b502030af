"""scripts/gpu_check.sh runs on a GPU machine whose Python has torch, triton, transformers and pytest but
none of compressed-tensors, llm-compressor, gguf or gensim (the device's package list): the kernel tests
and the kernel benchmark must import there, or the GPU session is lost to an ImportError."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ABSENT_ON_THE_GPU_MACHINE = ("compressed_tensors", "llmcompressor", "gguf", "gensim")


def test_kernel_tests_and_bench_import_without_the_cpu_only_packages() -> None:
    block = "".join(f"sys.modules[{name!r}] = None\n" for name in ABSENT_ON_THE_GPU_MACHINE)  # import fails
    code = (
        f"import sys\n{block}"
        "import kvq.runtime.kernels.bench\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '--collect-only', '-p', 'no:cacheprovider', '-m', 'gpu or not gpu',"
        " 'tests/runtime/kernels']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]  # 2: a collection error
