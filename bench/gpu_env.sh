# Sourced by bench/gpu_profiles.sh and bench/gpu_engine_tests.sh: the device tool's machine
# has torch with CUDA but not every package FleetShift imports, so the missing ones travel as
# wheels in .whl (bench/gpu_wheels.txt) and are installed to /tmp/site; the repository's own
# packages go on PYTHONPATH (no install). NO_WHEELS=1 skips the wheels (a try on this
# machine, with PY=.venv/bin/python). Leaves ROOT (the repository) as the working directory.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
if [[ -z ${NO_WHEELS:-} ]] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT:$ROOT/proto:$ROOT/common:$ROOT/agent:$ROOT/daemon"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
