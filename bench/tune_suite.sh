#!/usr/bin/env bash
# tune_suite.sh OUT_DIR -- issue 4's GPU evidence in one call: build, the tuning tests, micro + evo for v2 on two fa3
# shapes (D=64 and D=128, S=2048) and one seeds shape; each winner re-measured against the default, interleaved, and
# saved to OUT/tuned.json only if faster beyond the noise (fattn.tune's --save).
# Writes OUT/tune.log, OUT/tuned.json (if anything was confirmed), OUT/tune_logs.tgz (every micro/evo log).
# FATTN_TUNE_BUDGET (default 24) sets evo's budget; FATTN_GIT_SHA stamps a tree copied without .git.
set -uo pipefail
OUT=${1:?usage: tune_suite.sh OUT_DIR}
mkdir -p "$OUT/tune"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 FATTN_TUNED_CACHE="$OUT/tuned.json" FATTN_CACHE_DIR="$OUT/kernels"
LOG="$OUT/tune.log"
BUDGET=${FATTN_TUNE_BUDGET:-24}
if [ ! -f fattn/_C*.so ] && ! ls fattn/_C*.so >/dev/null 2>&1; then
  FATTN_CUDA_ARCHS="arch=compute_90,code=sm_90" python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
fi
python3 -m pytest -q -p no:cacheprovider tests/test_tune.py 2>&1 | tail -3 | tee -a "$LOG"
for spec in "8,32,2048,64 none" "8,16,2048,128 none" "8,16,512,64 none"; do
  set -- $spec
  dir="$OUT/tune/${1//,/x}"
  echo "== micro + evo $1 causal=$2" | tee -a "$LOG"
  python3 -m fattn.tune micro --shape "$1" --causal "$2" --out "$dir" --reps 10 --quiet 2>>"$LOG" | tee -a "$LOG"
  python3 -m fattn.tune evo --shape "$1" --causal "$2" --out "$dir" --budget "$BUDGET" --seed 0 --save 2>>"$LOG" | tee -a "$LOG"
done
tar czf "$OUT/tune_logs.tgz" -C "$OUT" tune && rm -rf "$OUT/tune" "$OUT/kernels"
echo "== summary"; grep -E "^evo|default|best|confirmed|not saved" "$LOG"
