#!/usr/bin/env bash
# sanitize.sh OUT_DIR [TOOLS] -- compute-sanitizer over bench/sanitize_sweep.py (every GPU variant, small odd
# shapes), one tool at a time (default: memcheck racecheck synccheck initcheck).  Writes OUT_DIR/sanitize.log, prints a summary.
set -uo pipefail
OUT=${1:?usage: sanitize.sh OUT_DIR [TOOLS]}
TOOLS=${2:-memcheck racecheck synccheck initcheck}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build
mkdir -p "$OUT"
LOG="$OUT/sanitize.log"
: > "$LOG"
rc=0
for tool in $TOOLS; do
  echo "== compute-sanitizer --tool $tool" | tee -a "$LOG"
  compute-sanitizer --tool "$tool" --error-exitcode 3 python3 bench/sanitize_sweep.py >> "$LOG" 2>&1
  r=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOG" | tail -1)
  echo "$tool: exit $r; ${summary:-no summary line}" | tee -a "$LOG"
  [ $r -ne 0 ] && rc=$r
done
exit $rc
