# Sourced by the other scripts: make .venv on first use (or when the pinned set changes) and
# put it on PATH. torch is installed first and pinned, so no CUDA build is ever pulled here.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.fleetshift-stamp"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" || "$(cat "$STAMP" 2>/dev/null)" != "$want" ]]; then
  echo "setting up $VENV (first use or changed dependencies) ..." >&2
  PY="${PYTHON:-python3.11}"
  command -v "$PY" >/dev/null || PY=python3
  "$PY" -m venv "$VENV"
  pipq() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" >&2 || true; }
  pipq --upgrade pip setuptools wheel
  pipq -c "$ROOT/constraints.txt" "torch==2.13.0"
  pipq -c "$ROOT/constraints.txt" -e "$ROOT[dev]"
  "$VENV/bin/python" -c "import torch, grpc, fleetshift_daemon" || { echo "set-up failed" >&2; exit 1; }
  echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
