#!/usr/bin/env bash
# The GPU device check, in one shot (benchmarks/gpu/kit.py says what each step measures).
#
#   bash benchmarks/gpu/run.sh          # on the GPU machine, from the repository root, with the
#                                       # wheels of fetch_wheels.sh in benchmarks/gpu/wheels/
#   bash benchmarks/gpu/run.sh --cpu    # every step but CUDA, on a CPU machine (tests/test_gpu_kit.py)
#
# Everything printed and results.json go to $OUT (default ./gpu-results). The whole check is
# bounded by KIT_TIMEOUT_S (default 480 s); the kit stops starting new steps at KIT_BUDGET_S.
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=gpu
if [ "${1:-}" = "--cpu" ]; then MODE=cpu; fi
OUT=${OUT:-./gpu-results}
WHEELS=${SLURMTRON_GPU_WHEELS:-benchmarks/gpu/wheels}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
: > "$OUT/run.log"
SITE=""
if [ "$MODE" = gpu ]; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "run.sh: no wheels in $WHEELS: run benchmarks/gpu/fetch_wheels.sh on a machine with pip access" | tee -a "$OUT/run.log"
        exit 2
    fi
    # --no-deps into a private target: the image's CUDA torch is never touched
    SITE=$(mktemp -d -t slurmtron-site.XXXXXX)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
        2>&1 | tee -a "$OUT/run.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || exit 2
else
    echo "run.sh --cpu: no wheel install (this machine has the CPU stack already)" | tee -a "$OUT/run.log"
fi
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
timeout "${KIT_TIMEOUT_S:-480}" "$PY" benchmarks/gpu/kit.py --mode "$MODE" --out "$OUT" \
    --budget-s "${KIT_BUDGET_S:-420}" 2>&1 | tee -a "$OUT/run.log"
rc=${PIPESTATUS[0]}
echo "run.sh: exit $rc; results in $OUT/results.json" | tee -a "$OUT/run.log"
exit "$rc"
