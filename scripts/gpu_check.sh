#!/usr/bin/env bash
# GPU check of the kvq kernels: the gpu-marked kernel tests (W4A16, fused MoE, GQA and MLA latent decode
# attention, KV store with slot stamps), the MLA engine on CUDA (tests/runtime/test_gpu_mla_engine.py: the
# fast path of the tiny DeepSeek-V3 and GLM-5 against transformers' fp32 forward; tests/runtime/test_spec_fast_path.py:
# --speculative mtp, its K + 1 verified rows through the Triton fused MoE and its MTP drafts through the
# Triton latent decode, each token the plain engine's argmax within bf16 rounding), then the kernel
# benchmark, whose table is printed and written to RESULTS_DIR/kernel_bench.json. Needs a CUDA device,
# torch with CUDA and triton (+ pytest, transformers); installs nothing; under 9 minutes (each step has a
# timeout).
# Usage: scripts/gpu_check.sh RESULTS_DIR
# Exit: 0 all good; 1 a test failed, a kernel mismatched its reference, a step errored or timed out;
#       2 usage or no CUDA device; 3 an H100/H200 target was missed (numbers still written).
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 RESULTS_DIR" >&2
    exit 2
fi
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$1"
results_dir=$(cd "$1" && pwd)
python=$repo_root/.venv/bin/python
[[ -x $python ]] || python=python3
cd "$repo_root"
unset KVQ_KERNELS  # auto dispatch
export TRITON_INTERPRET=0  # compiled kernels (tests/conftest.py would make them interpreted)

"$python" - <<'PY' || exit 2
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device; run this on a GPU machine")
import triton

print(f"gpu_check: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
PY

# Kernel test files that import the CPU machine's oracles (compressed-tensors), absent on the GPU machine.
cpu_oracle_tests=(--ignore=tests/runtime/kernels/test_w4a16_layout.py)

tests_status=0
timeout 120 "$python" -m pytest -q -m gpu -p no:cacheprovider "${cpu_oracle_tests[@]}" tests/runtime/kernels \
    --junitxml="$results_dir/kernel_gpu_tests.xml" 2>&1 | tee "$results_dir/kernel_gpu_tests.log" \
    || tests_status=$?

engine_status=0
timeout 240 "$python" -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_gpu_mla_engine.py \
    tests/runtime/test_spec_fast_path.py \
    --junitxml="$results_dir/mla_engine_gpu_tests.xml" 2>&1 | tee "$results_dir/mla_engine_gpu_tests.log" \
    || engine_status=$?

bench_status=0
timeout 170 "$python" -m kvq.bench.kernels --out "$results_dir/kernel_bench.json" 2>&1 \
    | tee "$results_dir/kernel_bench.log" || bench_status=$?

echo "gpu_check: tests exit $tests_status, MLA engine exit $engine_status, bench exit $bench_status;" \
    "results in $results_dir"
if [[ $tests_status -ne 0 || $engine_status -ne 0 ]]; then
    exit 1
fi
if [[ $bench_status -eq 3 ]]; then
    exit 3
fi
[[ $bench_status -eq 0 ]] || exit 1
