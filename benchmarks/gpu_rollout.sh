#!/usr/bin/env bash
# Rollout accelerators at real shapes on a GPU machine without network: each model of gpu_check.py's MODELS that is
# named (default sd35m and flux1-dev) is saved with random weights at its real widths, then benchmarks/rollout.py
# times plain pipe(...), the rollout and every accelerator on it (bfloat16, 512x512). Random weights: the lossy
# caches' skip rates on a trained model differ; compile, the attention backend and the rollout's overhead do not
# depend on the weights. The wheels travel as for gpu_check.sh (benchmarks/gpu_check.sh wheels).
#
#   benchmarks/gpu_rollout.sh OUT [MODEL ...]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: benchmarks/gpu_rollout.sh OUT [MODEL ...]}"
shift
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
knobs='{"attention_backend": {"backend": "_native_flash"}, "first_block_cache": {"threshold": 0.2},
 "mag_cache": {"mag_ratios": [1.0], "threshold": 0.5}}'
knobs="${KNOBS:-$knobs}"
device="${DEVICE:-cuda}"
work="$(mktemp -d -p "${WORK:-/dev/shm}")"
trap 'rm -rf "$work"' EXIT
for model in ${@:-sd35m flux1-dev}; do
  python3 benchmarks/gpu_check.py --out "$out" --save-model "$model" "$work/$model" ${TINY:+--tiny}
  python3 benchmarks/rollout.py --model "$work/$model" --device "$device" --dtype "${DTYPE:-bfloat16}" --height "${SIZE:-512}" --width "${SIZE:-512}" \
    --steps "${STEPS:-20}" --prompts 2 --group-size 2 --max-sequence-length 128 --repeats "${REPEATS:-5}" \
    --accelerators all --knobs "$knobs" \
    2>&1 | tee "$out/rollout_$model.txt" || echo "$model: rollout.py failed (see above)" | tee -a "$out/rollout_$model.txt"
  rm -rf "${work:?}/$model"
done
