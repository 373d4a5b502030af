#!/usr/bin/env bash
# Runs the CPU W4A16, W8A16, W4A8 and W8A8 kernel tests on every path, AVX-512 included, on a CPU that lacks
# some of them: builds the kernel with SIMDe's portable intrinsics (Debian/Ubuntu: apt-get install
# libsimde-dev) and loads that build in place of the installed one. It checks the intrinsics code's
# arithmetic, not its speed or the compiler's instruction selection. Usage: scripts/check_cpu_paths.sh [pytest args]
set -euo pipefail
PY=${PYTHON:-python}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
suffix=$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
include=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
${CC:-cc} -O1 -fPIC -shared -std=gnu11 -pthread -ffp-contract=off -Wno-psabi -DKVQ_SIMDE_CHECK -I"$include" \
    kvq/runtime/kernels/cpu/_linear.c -o "$out/_linear$suffix"
$PY - "$out/_linear$suffix" "$@" <<'PYTHON'
import importlib.util
import os
import sys

name = "kvq.runtime.kernels.cpu._linear"
spec = importlib.util.spec_from_file_location(name, sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sys.modules[name] = module
os.environ["KVQ_SIMDE_CHECK"] = "1"  # tests of hardware-only behaviour (vdpbf16ps flushing denormals) skip
assert module.isas() == ("scalar", "avx2", "avx512", "avx512bf16"), module.isas()
import pytest

tests = [
    "tests/runtime/kernels/test_w4a16_cpu.py",
    "tests/runtime/kernels/test_w4a16_cpu_vnni.py",
    "tests/runtime/kernels/test_w4a16.py",
    "tests/runtime/kernels/test_w8a16.py",
    "tests/runtime/kernels/test_w4a8_cpu.py",
    "tests/runtime/kernels/test_w8a8_cpu.py",
]
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *tests, "-k", "not triton", *sys.argv[2:]]))
PYTHON
