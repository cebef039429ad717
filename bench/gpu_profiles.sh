#!/usr/bin/env bash
# Profiles of the reference engine on a real GPU, for issue 12's hold-out (c) on a GPU: three
# seeded random models of different shape (depth, width, GQA ratio), each served by a real
# worker process with --device cuda in bfloat16 and swept by `fleetshift profile` (through
# bench/profile_cost.py). The profiles come back as one archive; `fleetshift calibration`
# fits on some and predicts the others on any machine (docs/bench-profile.md, "On a GPU").
#
# Written for the device tool's H200 (one call, well inside its 10-minute limit): that
# machine has torch with CUDA but not every package FleetShift needs, so the missing ones
# travel as wheels in .whl (bench/gpu_wheels.txt lists them). Run there as
#   bash bench/gpu_profiles.sh
# with $OUT set (what comes back). To try the script on a CPU before spending GPU time:
#   DEVICE=cpu SHAPES=tiny NO_WHEELS=1 PY=.venv/bin/python OUT=/tmp/o bash bench/gpu_profiles.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-profiles-out}
DEVICE=${DEVICE:-cuda}
BUDGET_S=${BUDGET_S:-70}     # no new point after this long, per model
LIMIT_S=${LIMIT_S:-175}      # each model's whole run (write, load, sweep) is killed after this
WORK=${WORK:-/tmp/gpu-profiles}
source "$(dirname "$0")/gpu_env.sh"
mkdir -p "$OUT" "$WORK/profiles"

{
  date -u +"started %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv 2>&1 || echo "no nvidia-smi"
  "$PY" -c "import sys, torch, grpc, google.protobuf as pb; print(sys.version.split()[0],
torch.__version__, torch.version.cuda, grpc.__version__, pb.__version__,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"
  nproc; free -g | head -2
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# name | KEY=INT overrides of the "small" preset; head_dim 128 throughout; vocab 32,000.
COMMON=vocab_size=32000,max_position_embeddings=4096
declare -A SHAPE=(
  [gpu-16l]=num_hidden_layers=16,hidden_size=2048,num_attention_heads=16,num_key_value_heads=4,intermediate_size=5632
  [gpu-8w]=num_hidden_layers=8,hidden_size=3072,num_attention_heads=24,num_key_value_heads=24,intermediate_size=8192
  [gpu-12m]=num_hidden_layers=12,hidden_size=2560,num_attention_heads=20,num_key_value_heads=4,intermediate_size=6912
  [tiny-a]=num_hidden_layers=2,hidden_size=128,num_attention_heads=2,num_key_value_heads=1,intermediate_size=256
  [tiny-b]=num_hidden_layers=4,hidden_size=128,num_attention_heads=2,num_key_value_heads=2,intermediate_size=384
)
TINY=(--prompt-sizes 64,128 --max-concurrency 4 --repeats 1)
FULL=(--prompt-sizes 128,512,2048 --max-concurrency 64 --repeats 2 --token-size 32)

profile() {  # name, limit_s, sweep...: one model's profile; its exit status
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date -u +%T))"
  timeout "$limit" "$PY" bench/profile_cost.py --preset small --name "$name" \
    --shape "$COMMON,${SHAPE[$name]}" --dtype bfloat16 --device "$DEVICE" \
    --num-blocks 12000 --out "$WORK/profiles" --time-budget-s "$BUDGET_S" "$@" \
    > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "exit $rc" >> "$WORK/$name.log"
  tail -8 "$WORK/$name.log"
  return $rc
}

# A tiny model first: a CUDA path that fails does so in seconds, not after a big model's
# weights were written and loaded.
NAMES=(tiny-a)
if profile tiny-a 90 "${TINY[@]}"; then
  if [[ "${SHAPES:-gpu}" == tiny ]]; then
    NAMES+=(tiny-b)
    profile tiny-b 90 "${TINY[@]}"
  else
    for name in gpu-16l gpu-8w gpu-12m; do
      NAMES+=("$name")
      profile "$name" "$LIMIT_S" "${FULL[@]}"
    done
  fi
fi

# What comes back: the profiles (CSV, sidecar, plot), each model's config.json (not its
# weights) and the logs, in one archive (the tool brings back at most 8 files).
(
  cd "$WORK"
  files=(*.log)
  for name in "${NAMES[@]}"; do
    for f in "profiles/$name.csv" "profiles/$name.json" "profiles/$name.png" \
      "profiles/$name/config.json"; do
      [[ -f $f ]] && files+=("$f")
    done
  done
  tar czf "$OUT/gpu-profiles.tar.gz" "${files[@]}"
)
date -u +"ended %Y-%m-%dT%H:%M:%SZ" | tee -a "$OUT/machine.txt"
