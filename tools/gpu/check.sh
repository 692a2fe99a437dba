#!/usr/bin/env bash
# The GPU check anyone can rerun (issue 53), on a CUDA machine (on an H200 on 2026-11-30 all but the
# llama-125m rows took 5.3 minutes, with longer windows than today's defaults): the `gpu` tests,
# bench/device_stage.py for gpt2-small and llama-125m in bf16 and fp32, the host path per micro-batch, the
# 4-stage swarm on the GPU against one process there (tools/gpu/one_gpu_swarm.py), and one table of what
# they measured (tools/gpu/summary.py).
#   Usage: tools/gpu/check.sh [WHEELS_DIR]   (or: make gpu-check [WHEELS=DIR])
# WHEELS_DIR: a wheelhouse from tools/gpu/wheelhouse.sh, installed offline into $SITE (default
# /tmp/swarmtrain-site) for the image's python3; without it the current environment must have swarmtrain's
# dependencies (e.g. `make setup` with a CUDA torch, see the README). Logs and JSON go to $OUT (default
# ./gpu-out). Environment: PYTHON, PRESETS, DTYPES, DUR (window seconds), T_TESTS / T_BENCH (limits, s),
# SWARM_S (the swarm's training seconds; 0 skips it).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd); cd "$root"
OUT=${OUT:-$root/gpu-out}; mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ -n "${1:-}" ]; then
    site=${SITE:-/tmp/swarmtrain-site}
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$1"/*.whl \
        || { echo "gpu-check: installing the wheels of $1 failed"; exit 2; }
    chmod +x "$site"/hivemind/hivemind_cli/p2pd "$site"/bin/* 2>/dev/null
    # the source tree first: the wheelhouse's own swarmtrain wheel may be older than it
    export PYTHONPATH="$root/src:$site" PATH="$site/bin:$PATH"
    mkdir -p "$site/bin" && printf '#!/bin/sh\nexec %s -m swarmtrain.cli.main "$@"\n' "$PYTHON" > "$site/bin/swarmtrain"
    chmod +x "$site/bin/swarmtrain"
fi
"$PYTHON" - <<'EOF' || exit 2
import sys
try:
    import hivemind, swarmtrain, torch
except ImportError as exc:
    sys.exit(f"gpu-check: {exc}: install swarmtrain's dependencies (README, 'GPUs'), or pass a wheelhouse")
if not torch.cuda.is_available():
    sys.exit(f"gpu-check: torch {torch.__version__} sees no CUDA device")
print("torch", torch.__version__, torch.cuda.get_device_name(), "hivemind", hivemind.__version__)
EOF
echo "== gpu tests ($(date +%T))"
# only the files that hold gpu tests: collecting the others needs the dev tools (grimp, ...) an image lacks
timeout "${T_TESTS:-120}" "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    $(grep -rlE "pytest\.mark\.gpu" tests) > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests: exit $?, $(tail -1 "$OUT/gpu_tests.log")"
for preset in ${PRESETS:-gpt2-small llama-125m}; do
    # issue 53 states batching and the swapper for gpt2-small: other presets get the served rows only
    rows=served; [ "$preset" = gpt2-small ] && rows=served,batching,swap
    echo "== bench/device_stage.py $preset, $rows ($(date +%T))"
    timeout "${T_BENCH:-260}" "$PYTHON" bench/device_stage.py --device cuda --preset "$preset" --rows "$rows" \
        --dtypes "${DTYPES:-bf16,fp32}" --trainers 4 --duration-s "${DUR:-6}" --warmup-s 2 \
        --local-duration-s 1.5 --summary-json "$OUT/device_stage_$preset.json" > "$OUT/device_stage_$preset.log" 2>&1
    echo "device_stage $preset: exit $?"
done
echo "== bench/host_path.py ($(date +%T))"
timeout 60 "$PYTHON" bench/host_path.py --device cuda > "$OUT/host_path.log" 2>&1; cat "$OUT/host_path.log"
if [ "${SWARM_S:-40}" != 0 ]; then
    echo "== tools/gpu/one_gpu_swarm.py gpt2-small bf16 ($(date +%T))"
    "$PYTHON" tools/gpu/one_gpu_swarm.py --preset gpt2-small --device cuda --dtype bf16 --duration-s "${SWARM_S:-40}" \
        --workdir "$OUT/one_gpu_swarm" --summary-json "$OUT/one_gpu_swarm.json" | tail -1
fi
"$PYTHON" tools/gpu/summary.py "$OUT"/device_stage_*.json "$OUT"/one_gpu_swarm.json | tee "$OUT/summary.txt"
