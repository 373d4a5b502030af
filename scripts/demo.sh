#!/usr/bin/env bash
# `make demo`: the main job end to end on the embedded default model (SmolLM2-135M-Instruct).
set -euo pipefail

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "Building the embedded default model (first run only)"
BF16=$(kvq default-model --format bf16)
FP8=$(kvq default-model --format fp8-block)
echo "bf16:      $BF16"
echo "fp8-block: $FP8"

step "kvq inspect: the BF16 source"
kvq inspect "$BF16"

step "kvq inspect: the FP8-block source"
kvq inspect "$FP8"
