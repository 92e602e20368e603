#!/usr/bin/env bash
# The GPU check where the GPU machine has no network (no package registry): flowrl runs from this checkout, and the
# packages that machine lacks travel as wheels in .whl/ (diffusers and importlib_metadata: the machine has torch,
# transformers, accelerate, peft, safetensors, numpy, pillow, pyyaml, tqdm and matplotlib).
#
#   benchmarks/gpu_check.sh wheels              # here, with network: download the wheels into .whl/ (Python 3.12)
#   benchmarks/gpu_check.sh OUT [ARGS...]       # there: install .whl/*.whl into /tmp/site, run gpu_check.py --out OUT
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="diffusers==0.42.1 importlib_metadata"
PYVER="${PYVER:-3.12}"
if [ "${1:-}" = wheels ]; then
  python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $WHEELS
  exit 0
fi
out="${1:?usage: benchmarks/gpu_check.sh OUT [gpu_check.py arguments] (or: benchmarks/gpu_check.sh wheels)}"
shift
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 benchmarks/gpu_check.py --out "$out" "$@"
