#!/usr/bin/env bash
# The engine's exactness tests with every engine on a GPU: batch invariance, snapshot +
# SIGKILL + restore, session moves with their KV between two worker processes, live moves
# (pre-copy + delta). Their reference runs are on the same GPU (FLEETSHIFT_TEST_DEVICE=cuda
# reaches tests/engine/helpers.py and the worker processes), so "exact" means what the
# snapshot promise says: the same bits on the same GPU model. For the device tool's H200;
# the packages its image lacks travel as wheels in .whl (bench/gpu_wheels.txt).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-engine-tests-out}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
export FLEETSHIFT_TEST_DEVICE=${FLEETSHIFT_TEST_DEVICE:-cuda}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1
timeout "${LIMIT_S:-200}" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/engine/test_batch_invariance.py tests/engine/test_worker_moves.py \
  tests/engine/test_live_migration.py 2>&1 | tee "$OUT/engine-tests.log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/engine-tests.log"
