#!/usr/bin/env bash
# Extraction figures on one GPU (sized for an H200), in under 8 minutes, from the repository root:
#
#   (a) extract tokens/s of the Transformers and vLLM engines (tools/bench_extract.py --device cuda: the same
#       shards, ExtractLane.run as a worker runs it, each engine in its own process, the ratio vllm/transformers)
#       on random-weight models of the 27B-32B class's width with few layers, so that they load fast:
#         dense   Qwen3-32B's shape (hidden 5120, 64 heads x 128 / 8 kv heads, intermediate 25600), 6 layers;
#         hybrid  examples/qwen3.6-27b-class/config.json (Qwen3.5: 3 Gated DeltaNet layers to 1 attention
#                 layer), 8 layers;
#       captured layers end at the last layer, so both engines run every layer, as they run all but the top
#       two or three of a full-depth target; the vocabulary is cut to 32768 (the prefill's work does not depend
#       on it, its load time does);
#   (b) the canary's cost: bench_extract.py reruns samples alone after the timed part (through the model's own
#       attention, or as a batch of one through vLLM) and prints their time per token over the batched one;
#   (c) vLLM against Transformers in bfloat16: the worst relative error per layer over every sample of the
#       first round (bench_extract.py's agreement line);
#   (d) generation tokens/s with and without speculative decoding (tools/bench_speculative.py, on the dense
#       checkpoint): n-gram drafting on prompts where drafts are rejected (its overhead) and on repetitive prompts
#       (where they are accepted), with the acceptance vLLM counted. Random weights have no trained MTP head, so
#       MTP's speed-up is not measured: its acceptance would mean nothing.
#
# Environment: a Python with CUDA torch, vLLM and this package ($PYTHON, else $DFQ_GPU_VENV, default
# .cache/venv-gpu, created when missing). When it lacks them, `pip install 'vllm>=0.32,<0.33'` (the GPU build,
# with the CUDA torch it pins), then `pip install -e '.[test]'`, then, optionally, flash-linear-attention (the
# Transformers engine's fast Gated DeltaNet kernels; without it its hybrid figure is that of Transformers' PyTorch
# fallback) and, with GPU_CHECK_CAUSAL_CONV1D=1, causal-conv1d. Nothing else is downloaded: the checkpoints are
# built here (tools/build_random_checkpoint.py) with the tiny test tokenizer.
#
# Every step is time-boxed (`timeout`, never past the overall budget, GPU_CHECK_BUDGET_S, default 450 s); a step
# that fails or runs out of time is reported and the next one runs. The figures go to $OUT/gpu_check.txt when
# OUT is set, else ./gpu_check.txt; each step's full output stays in $GPU_CHECK_WORK (default /tmp/dfq-gpu-check).
#
#     bash tools/gpu_check.sh
set -uo pipefail

if [ "${1:-}" = "--install" ]; then
  # The environment, run as a step of its own (below) so that its time is boxed too.
  set -e
  venv=$2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
  pip install --upgrade pip
  pip install 'vllm>=0.32,<0.33'
  pip install -e '.[test]'
  # Optional. causal-conv1d is a source package whose build compiles CUDA kernels (or fetches a binary from
  # outside the package index): only on request; without it Transformers runs the short convolution in PyTorch.
  pip install flash-linear-attention || echo "optional: flash-linear-attention not installed"
  if [ "${GPU_CHECK_CAUSAL_CONV1D:-0}" = 1 ]; then
    timeout 240 "$venv/bin/python" -m pip install -q --no-build-isolation causal-conv1d \
      || echo "optional: causal-conv1d not installed"
  fi
  exit 0
fi

START=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
WORK=${GPU_CHECK_WORK:-/tmp/dfq-gpu-check}
RESULTS=${OUT:-.}/gpu_check.txt
VENV=${DFQ_GPU_VENV:-.cache/venv-gpu}
PY=${PYTHON:-$VENV/bin/python}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$WORK" "$(dirname "$RESULTS")"
: > "$RESULTS"

log() { echo "$*" | tee -a "$RESULTS"; }
elapsed() { echo $(( $(date +%s) - START )); }

# step NAME SECONDS COMMAND...: COMMAND under `timeout`, at most SECONDS and never past the budget; its stdout
# (the figures) goes to the results, its stderr to $WORK/NAME.err (the last lines into the results on failure).
step() {
  local name=$1 box=$2
  shift 2
  local left=$(( BUDGET_S - $(elapsed) ))
  if (( left < 15 )); then
    log "== $name: skipped, the ${BUDGET_S} s budget is spent"
    return 1
  fi
  (( box > left )) && box=$left
  log "== $name (at most ${box} s; $(elapsed) s elapsed)"
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=15 "$box" "$@" 2> "$WORK/$name.err" | tee -a "$RESULTS"
  rc=${PIPESTATUS[0]}
  if (( rc == 124 || rc == 137 )); then
    log "-- $name: TIMED OUT after ${box} s"
  elif (( rc != 0 )); then
    log "-- $name: FAILED (exit $rc); the end of its stderr:"
    tail -n 25 "$WORK/$name.err" | tee -a "$RESULTS"
  else
    log "-- $name: ok in $(( $(date +%s) - t0 )) s"
  fi
  return "$rc"
}

ready() {
  "$PY" - <<'EOF' 2>/dev/null
import torch, vllm, transformers, psutil, tomli_w, dflash_queue
assert torch.cuda.is_available()
EOF
}

DESCRIBE='
import importlib, torch
found = []
for name in ["vllm", "transformers", "fla", "causal_conv1d"]:
    try:
        found.append(f"{name} {importlib.import_module(name).__version__}")
    except Exception:
        found.append(f"{name} absent")
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible"
print(f"environment: torch {torch.__version__} (CUDA {torch.version.cuda}), " + ", ".join(found) + f"; {gpu}")
'

log "gpu check: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /' \
  | tee -a "$RESULTS"

if ! ready; then
  step setup 300 bash "$0" --install "$VENV"
  PY=$VENV/bin/python
fi
step environment 60 "$PY" -c "$DESCRIBE"
ENGINES=transformers,vllm
if ! "$PY" -c 'import vllm' 2>/dev/null; then
  ENGINES=transformers
  log "vllm does not import: Transformers figures only"
fi

CKPT=$WORK/checkpoints
# What the benches share: bfloat16 on the GPU, K=5 captured layers stored as bfloat16, sequences of 256-4096
# tokens (log-uniform), the engines' default settings otherwise (token budget 16384; vLLM sizes its KV cache).
BENCH=(tools/bench_extract.py --device cuda --dtype bfloat16 --min-len 256 --max-len 4096 --engines "$ENGINES")

step build-dense 90 "$PY" tools/build_random_checkpoint.py --like qwen3-32b --layers 6 --vocab-size 32768 \
  --device cuda --out "$CKPT/qwen3-32b-6l" \
  && step bench-dense 190 "$PY" "${BENCH[@]}" --model "$CKPT/qwen3-32b-6l" --layer-ids 1,2,3,4,5 \
    --shards 2 --shard-size 64 --rounds 2 --out "$WORK/bench-dense"

step build-hybrid 90 "$PY" tools/build_random_checkpoint.py --like examples/qwen3.6-27b-class/config.json \
  --layers 8 --vocab-size 32768 --set vision_config.depth=1 --device cuda --out "$CKPT/qwen3.6-27b-8l" \
  && step bench-hybrid 170 "$PY" "${BENCH[@]}" --model "$CKPT/qwen3.6-27b-8l" --layer-ids 1,3,5,6,7 \
    --shards 1 --shard-size 64 --rounds 1 --out "$WORK/bench-hybrid"

if [[ $ENGINES == *vllm* ]] && [ -d "$CKPT/qwen3-32b-6l" ]; then
  step bench-speculative 150 "$PY" tools/bench_speculative.py --model "$CKPT/qwen3-32b-6l" --device cuda \
    --prompts 256 --prompt-len 512 --max-tokens 256 --k 3
fi

log "gpu check done in $(elapsed) s; results in $RESULTS"
