#!/usr/bin/env bash
# `make demo`: the main job end to end on the embedded default model (SmolLM2-135M-Instruct):
# inspect -> plan -> compress (FP8-block -> INT4) -> calibrate FP8 KV scales -> eval -> generate.
set -euo pipefail

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "Building the embedded default model (first run only)"
BF16=$(kvq default-model --format bf16)
FP8=$(kvq default-model --format fp8-block)
INT4="$(dirname "$FP8")/int4-w4a16-linear-g64"
echo "bf16:      $BF16"
echo "fp8-block: $FP8"

step "kvq inspect: the BF16 source"
kvq inspect "$BF16"

step "kvq inspect: the FP8-block source"
kvq inspect "$FP8"

step "kvq plan: FP8-block SmolLM2 -> INT4 (every Linear, group 64), one 24 GB GPU, BF16 vs FP8 KV"
kvq plan "$FP8" --recipe w4a16-linear --group-size 64 --tp 1 --gpu-mem 24GB

step "kvq compress: FP8-block -> compressed-tensors pack-quantized INT4 (a re-run resumes)"
kvq compress "$FP8" "$INT4" --recipe w4a16-linear --group-size 64 --workers 2

step "kvq calibrate: FP8 KV-cache scales from 16 x 512 tokens of bundled Wikipedia"
kvq calibrate "$INT4" --num-samples 16 --seq-len 512

step "kvq inspect: the compressed, calibrated checkpoint"
kvq inspect "$INT4"

step "kvq plan: the compressed checkpoint as it is (no recipe), 90% of a 24 GB GPU"
kvq plan "$INT4" --tp 1 --gpu-mem 24GB --mem-fraction 0.9

step "kvq eval: perplexity of the INT4 + FP8-KV model vs the BF16 source, through the runtime"
kvq eval "$INT4" --baseline "$BF16" --num-windows 8 --seq-len 128 --threads 2 --kv-memory 64MiB

step "kvq generate: INT4 weights, FP8 KV pages with the calibrated scales, every page checked by tag"
kvq generate "$INT4" "What is the capital of France?" --max-tokens 64 --require-kv-scales --kv-memory 256MiB \
    --kv-integrity tags --threads 2
