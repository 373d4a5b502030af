"""Every launcher's exact launch compiles for sm_90 (H100/H200) on this CPU machine, with Triton's
bundled ptxas: compile errors that the interpreter cannot see show up in `make test`, not on the GPU.

The launches are recorded and compiled by `sm90_launches` in a process of its own with compiled (not
interpreted) kernels: this test process imported triton with TRITON_INTERPRET=1 (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_every_launch_compiles_for_sm90() -> None:
    # TRITON_DEFAULT_FP_FUSION: the current default, stated to silence its warning
    env = os.environ | {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.runtime.kernels.sm90_launches"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    launches = [json.loads(line) for line in result.stdout.splitlines()]
    assert Counter(launch["kernel"] for launch in launches) == {
        "w4a16_kernel": 5,  # 3 linear launches, the fused MoE's 2 GEMMs
        "paged_decode_kernel": 2,
        "store_kv_kernel": 2,
        "latent_decode_kernel": 2,  # FP8 pages split 3 ways, BF16 pages over a DSA selection
    }
    assert all(launch["mma"] for launch in launches if launch["kernel"] != "store_kv_kernel")  # tensor cores
