#!/usr/bin/env bash
# Extraction figures on one GPU (sized for one H200), in at most 8 minutes, on a machine with no network and no
# registry, with the image's own python3 and its CUDA torch and transformers:
#
#   bash tools/gpu_check.sh OUT_DIR          # OUT_DIR, else $OUT, else ./gpu-check-out
#
# Before: `python tools/build_gpu_bundle.py build` here makes gpu-bundle/ (this package and the wheels the image
# lacks, the tiny test tokenizer); it travels with the checkout (DEVELOPERS.md, "On a GPU machine").
#
# Steps, each time-boxed (`timeout`, never past the budget GPU_CHECK_BUDGET_S, default 420 s, which leaves the
# report and a killed step's grace inside 8 minutes); a step that fails or runs out of time is recorded and the
# next one runs:
#   install        the bundle's wheels the image lacks into $WORK/site (then on PYTHONPATH), pip --no-index;
#                  the installed package imported from there alone. The image's own packages stay as they are.
#   environment    Python, torch and CUDA, the GPU, transformers, triton, flash-linear-attention, vLLM.
#   dense          a random-weight checkpoint of Qwen3-32B's shape (hidden 5120, 64 x 128 heads / 8 kv heads,
#                  intermediate 25600), 6 layers, vocabulary cut to 32768 (tools/build_random_checkpoint.py),
#                  then tools/bench_extract.py: the Transformers extract lane's tokens/s and MFU against
#                  790 TFLOP/s, the engine alone, the canary's share of a shard's extract time, and the
#                  agreement in bfloat16 with the checkpoint's own class run on each sample alone.
#   host-path      tools/bench_host_path.py --device DEVICE --json FILE, when the checkout has it: GB/s of each
#                  engine's hand-over form to a stored local shard, beside a copy.
#   hybrid         the same on examples/qwen3.6-27b-class/config.json (Qwen3.5: 3 Gated DeltaNet layers to 1
#                  attention layer), 8 layers; the Gated DeltaNet kernels are flash-linear-attention's (triton)
#                  when `fla` imports, and the figures say which ran. Should that fail, once more with `fla` kept
#                  out (Transformers' PyTorch fallback), on fewer samples.
#   vllm           only where vLLM imports (else one line saying why): the dense bench with both engines (the
#                  ratio vllm/transformers and their agreement) and tools/bench_speculative.py.
#   report         every figure into OUT_DIR/gpu_check.json (tools/gpu_check_report.py), printed too; the
#                  transcript in OUT_DIR/gpu_check.log.
#
# Settings (environment): PYTHON (default python3), GPU_CHECK_BUNDLE (default gpu-bundle), GPU_CHECK_WORK (a new
# or empty folder, kept; default a new one under /tmp, removed at the end unless GPU_CHECK_KEEP_WORK=1),
# GPU_CHECK_DEVICE (cuda or cpu; default cuda when torch sees one: without one the full shapes are refused at once
# unless GPU_CHECK_DEVICE=cpu), GPU_CHECK_SHAPE (full, or small: tiny shapes and workloads for a CPU run of this
# same script, as tests/tools/test_gpu_check.py does), GPU_CHECK_BUDGET_S, GPU_CHECK_DRY_RUN=1 (print each step's
# command, run none, as if vLLM imported and every branch were taken: the tests check those commands against the
# tools' parsers).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
START=$(date +%s)
DEST=${1:-${OUT:-$REPO/gpu-check-out}}
PY=${PYTHON:-python3}
BUNDLE=${GPU_CHECK_BUNDLE:-$REPO/gpu-bundle}
SHAPE=${GPU_CHECK_SHAPE:-full}
BUDGET_S=${GPU_CHECK_BUDGET_S:-420}
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
case $SHAPE in full|small) ;; *) echo "GPU_CHECK_SHAPE: full or small, not $SHAPE" >&2; exit 2 ;; esac
# The full shapes measure a GPU: without one they would run for minutes on host cores and measure nothing. Refused
# at once, unless a CPU run is asked for by name (GPU_CHECK_DEVICE=cpu; its report says device cpu).
if [ "$DRY_RUN" != 1 ] && [ "$SHAPE" = full ] && [ -z "${GPU_CHECK_DEVICE:-}" ] \
    && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu check: torch in $PY sees no CUDA device (or does not import): the full shapes measure a GPU and on" \
    "host cores would run for minutes and measure nothing. Run it on a GPU node; GPU_CHECK_SHAPE=small runs the same" \
    "steps on tiny shapes (a check of the script and the bundle, its figures labelled cpu); GPU_CHECK_DEVICE=cpu" \
    "forces the full shapes on host cores" >&2
  exit 2
fi
if [ -n "${GPU_CHECK_WORK:-}" ]; then
  WORK=$GPU_CHECK_WORK
  if [ -e "$WORK" ] && [ -n "$(ls -A "$WORK")" ]; then
    echo "GPU_CHECK_WORK=$WORK is not empty" >&2
    exit 2
  fi
  mkdir -p "$WORK"
else
  WORK=$(mktemp -d /tmp/dfq-gpu-check.XXXXXX)
  # Checkpoints and states of several GB: gone with the script unless asked to keep them.
  [ "${GPU_CHECK_KEEP_WORK:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$DEST"
LOG=$DEST/gpu_check.log
STEPS=$WORK/steps.jsonl
SITE=$WORK/site
: > "$LOG"
: > "$STEPS"

# Nothing is fetched: no index for pip, no hub for Transformers, no configuration that names one.
export PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export HF_HOME=$WORK/hf-home PYTHONUNBUFFERED=1 PYTHONNOUSERSITE=1
unset PYTHONPATH

log() { echo "$*" | tee -a "$LOG"; }
elapsed() { echo $(( $(date +%s) - START )); }
record() {  # record NAME STATUS SECONDS RC
  printf '{"name": "%s", "status": "%s", "seconds": %s, "rc": %s}\n' "$1" "$2" "$3" "$4" >> "$STEPS"
}

# step NAME SECONDS COMMAND...: COMMAND under `timeout`, at most SECONDS and never past the budget; its stdout
# goes to the transcript, its stderr to $WORK/NAME.err (the last lines into the transcript on failure).
step() {
  local name=$1 box=$2
  shift 2
  local left=$(( BUDGET_S - $(elapsed) ))
  if (( left < 15 )); then
    log "== $name: skipped, the ${BUDGET_S} s budget is spent"
    record "$name" skipped 0 null
    return 1
  fi
  (( box > left )) && box=$left
  if [ "$DRY_RUN" = 1 ]; then
    log "DRY $name $box: $(printf '%q ' "$@")"
    return 0
  fi
  log "== $name (at most ${box} s; $(elapsed) s elapsed)"
  local t0 rc status
  t0=$(date +%s)
  timeout --kill-after=15 "$box" "$@" 2> "$WORK/$name.err" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  if (( rc == 124 || rc == 137 )); then
    status=timeout
    log "-- $name: TIMED OUT after ${box} s"
  elif (( rc != 0 )); then
    status=failed
    log "-- $name: FAILED (exit $rc); the end of its stderr:"
    tail -n 25 "$WORK/$name.err" | tee -a "$LOG"
  else
    status=ok
    log "-- $name: ok in $(( $(date +%s) - t0 )) s"
  fi
  record "$name" "$status" "$(( $(date +%s) - t0 ))" "$rc"
  return "$rc"
}

skip() {  # skip NAME WHY
  log "== $1: skipped, $2"
  record "$1" skipped 0 null
}

report() {
  [ "$DRY_RUN" = 1 ] && return 0
  log "== report ($(elapsed) s elapsed)"
  timeout 30 "$PY" tools/gpu_check_report.py merge --work "$WORK" --out "$DEST/gpu_check.json" \
    --started "$START" --shape "$SHAPE" --device "${DEVICE:-unknown}" 2> "$WORK/report.err" | tee -a "$LOG"
  if (( PIPESTATUS[0] != 0 )); then
    log "-- report: FAILED; the end of its stderr:"
    tail -n 25 "$WORK/report.err" | tee -a "$LOG"
  fi
  log "gpu check done in $(elapsed) s; figures in $DEST/gpu_check.json, transcript in $LOG"
}

log "gpu check: $(date -u +%Y-%m-%dT%H:%M:%SZ), $SHAPE shapes, work in $WORK, python $(command -v "$PY")"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /' \
  | tee -a "$LOG"

# The image's packages as they are; what it lacks from the bundle, into a folder of its own.
if ! step install 90 "$PY" tools/build_gpu_bundle.py install --bundle "$BUNDLE" --target "$SITE" \
    --json "$WORK/install.json"; then
  log "the bundle did not install: nothing else can run"
  report
  exit 1
fi
export PYTHONPATH=$SITE

DEVICE=${GPU_CHECK_DEVICE:-$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")' \
  2>/dev/null || echo cpu)}
step environment 90 "$PY" tools/gpu_check_report.py environment --json "$WORK/environment.json"
ENGINES=transformers
VLLM_MISSING=
if [ "$DRY_RUN" = 1 ] || VLLM_MISSING=$(timeout 120 "$PY" -c 'import vllm' 2>&1); then
  VLLM_MISSING=
  ENGINES=transformers,vllm
else
  VLLM_MISSING=$(echo "$VLLM_MISSING" | tail -n 1)
fi

CKPT=$WORK/checkpoints
TOKENIZER=(--tokenizer "$BUNDLE/tokenizer")
BUILD=(tools/build_random_checkpoint.py --device "$DEVICE" "${TOKENIZER[@]}")
# What the benches share: bfloat16, states stored as bfloat16, the engines' default settings otherwise (token
# budget 16384; vLLM sizes its KV cache). Sequences of 256-4096 tokens (log-uniform) on the GPU.
BENCH=(tools/bench_extract.py --device "$DEVICE" --dtype bfloat16 --peak-tflops 790)
if [ "$SHAPE" = full ]; then
  DENSE=(--like qwen3-32b --layers 6 --vocab-size 32768)
  HYBRID=(--like examples/qwen3.6-27b-class/config.json --layers 8 --vocab-size 32768 --set vision_config.depth=1)
  # 64 samples of 256-4096 tokens (about 88,000 tokens, 4.5 GB of states) per model: a minute or two each.
  WORKLOAD=(--min-len 256 --max-len 4096 --shard-size 32 --reference-samples 3)
  DENSE_RUN=(--layer-ids 1,2,3,4,5 --shards 2 --rounds 1)
  HYBRID_RUN=(--layer-ids 1,3,5,6,7 --shards 2 --rounds 1)
  FALLBACK_RUN=(--layer-ids 1,3,5,6,7 --shards 1 --rounds 1 --min-len 256 --max-len 2048 --shard-size 16
    --reference-samples 2)
else
  # Tiny widths, the same classes and layer kinds: the whole script in a minute or two on a CPU.
  SMALL=(--vocab-size 2048)
  TEXT=(hidden_size=128 intermediate_size=256 num_attention_heads=4 num_key_value_heads=2 head_dim=32)
  DENSE=(--like qwen3-32b --layers 3 "${SMALL[@]}")
  for kv in "${TEXT[@]}"; do DENSE+=(--set "$kv"); done
  HYBRID=(--like examples/qwen3.6-27b-class/config.json --layers 4 "${SMALL[@]}")
  for kv in "${TEXT[@]}" linear_num_key_heads=2 linear_num_value_heads=4 linear_key_head_dim=32 \
      linear_value_head_dim=32; do
    HYBRID+=(--set "text_config.$kv")
  done
  HYBRID+=(--set vision_config.depth=1 --set vision_config.hidden_size=32 --set vision_config.intermediate_size=64
    --set vision_config.num_heads=2 --set vision_config.out_hidden_size=128)
  WORKLOAD=(--min-len 16 --max-len 160 --shard-size 8 --reference-samples 2 --canary-measured 2)
  DENSE_RUN=(--layer-ids 0,1,2 --shards 1 --rounds 1)
  HYBRID_RUN=(--layer-ids 0,1,2,3 --shards 1 --rounds 1)
  FALLBACK_RUN=("${HYBRID_RUN[@]}")
fi

step build-dense 90 "$PY" "${BUILD[@]}" "${DENSE[@]}" --out "$CKPT/dense" \
  && step bench-dense 150 "$PY" "${BENCH[@]}" --model "$CKPT/dense" --engines "$ENGINES" "${WORKLOAD[@]}" \
    "${DENSE_RUN[@]}" --out "$WORK/bench-dense" --json-file "$WORK/bench-dense.json"

if [ -f tools/bench_host_path.py ]; then
  step host-path 60 "$PY" tools/bench_host_path.py --device "$DEVICE" --json "$WORK/host-path.json"
else
  skip host-path "tools/bench_host_path.py is not in this checkout"
fi

if step build-hybrid 90 "$PY" "${BUILD[@]}" "${HYBRID[@]}" --out "$CKPT/hybrid"; then
  hybrid_failed=0
  step bench-hybrid 150 "$PY" "${BENCH[@]}" --model "$CKPT/hybrid" --engines transformers "${WORKLOAD[@]}" \
    "${HYBRID_RUN[@]}" --out "$WORK/bench-hybrid" --json-file "$WORK/bench-hybrid.json" || hybrid_failed=1
  if [ "$DRY_RUN" = 1 ] || { [ $hybrid_failed = 1 ] && "$PY" -c 'import fla.ops.gated_delta_rule' 2>/dev/null; }; then
    # flash-linear-attention imported and the run failed: Transformers' PyTorch Gated DeltaNet instead.
    mkdir -p "$WORK/keep-out/fla"
    echo 'raise ImportError("flash-linear-attention kept out by tools/gpu_check.sh")' > "$WORK/keep-out/fla/__init__.py"
    step bench-hybrid-torch 90 env PYTHONPATH="$WORK/keep-out:$SITE" "$PY" "${BENCH[@]}" --model "$CKPT/hybrid" \
      --engines transformers "${WORKLOAD[@]}" "${FALLBACK_RUN[@]}" --out "$WORK/bench-hybrid-torch" \
      --json-file "$WORK/bench-hybrid-torch.json"
  fi
fi

if [ -n "$VLLM_MISSING" ]; then
  skip vllm "vllm does not import ($VLLM_MISSING): no vLLM figures (bench-dense ran the Transformers engine alone)"
elif [ "$DRY_RUN" = 1 ] || [ -d "$CKPT/dense" ]; then
  step bench-speculative 150 "$PY" tools/bench_speculative.py --model "$CKPT/dense" --device "$DEVICE" \
    --prompts 256 --prompt-len 512 --max-tokens 256 --k 3
fi

report
