#!/usr/bin/env bash
# gpu_suite.sh OUT_DIR [GRIDS] -- the whole GPU job in one call: build, GPU tests, benchmark grids, and what is asked.
#
#   bash bench/gpu_suite.sh "$OUT"                          # seeds + fa3 + decode
#   bash bench/gpu_suite.sh "$OUT" "seeds fa3 fa3_bf16"     # a subset (fa3_bf16: the fa3 grid in bfloat16)
#   bash bench/gpu_suite.sh "$OUT" "fa3_bwd fa3_fwdbwd"     # --mode bwd / fwdbwd on fa3 (fa3_bf16_bwd in bf16)
#   bash bench/gpu_suite.sh "$OUT" cp                       # context parallelism over every GPU (torchrun, NCCL)
#   bash bench/gpu_suite.sh "$OUT" serving                  # bench/serving_targets.py (FATTN_SERVING_TARGETS=a,b)
#   FATTN_AB_OLD=.ab/old bash bench/gpu_suite.sh "$OUT" none    # this tree against an older one (bench/ab.py;
#       .ab/ is git-ignored: the older sources, e.g. `git archive SHA csrc kernels fattn setup.py pyproject.toml
#       README.md | tar -x -C .ab/old`, reach the GPU machine through the device tool's carry=[".ab"])
#   FATTN_AB_OLD=.ab/old FATTN_AB_GRIDS=fa3_bwd ...             # the same for v3's backward, both modes
#   FATTN_SANITIZE=1 bash bench/gpu_suite.sh "$OUT" none    # also compute-sanitizer (FATTN_SANITIZE_TOOLS, default memcheck racecheck)
#   FATTN_SMOKE=v3 FATTN_PYTEST_ARGS="-k v3" bash bench/gpu_suite.sh "$OUT" fa3   # bench/smoke.py first, some tests
#   FATTN_VARIANTS=v2,v3 FATTN_TORCH_BACKENDS=flash,cudnn ...   # fewer columns
#
# Writes to OUT_DIR: suite.log (environment, build, pytest), <grid>.json per grid (stamped with GPU, driver, CUDA,
# torch, cuDNN, git SHA), summary.md (every grid's Markdown table), ab.json (FATTN_AB_OLD: bench/ab.py, this tree's
# v2 / v3 against the older tree's, interleaved, over FATTN_AB_GRIDS, default "seeds seeds_e2e fa3 decode"),
# kernel_report.md,
# sanitize.log when asked; prints a short summary table last.  A tree copied without .git is stamped through
# FATTN_GIT_SHA=$(git rev-parse HEAD), set by the caller.
set -uo pipefail
OUT=${1:?usage: gpu_suite.sh OUT_DIR [GRIDS]}
GRIDS=${2:-seeds fa3 decode}
mkdir -p "$OUT"
MD_DIR=$(mktemp -d)
: > "$OUT/summary.md"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
LOG="$OUT/suite.log"
: > "$LOG"
say() { echo "== $*" | tee -a "$LOG"; }

say "environment"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv; nvcc --version | tail -2
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())'
  echo "git ${FATTN_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null)}"; } >> "$LOG" 2>&1

say "build"
t0=$(date +%s)
OLD_PID=
if [ -n "${FATTN_AB_OLD:-}" ]; then  # the older tree builds beside this one
  bash bench/old_tree.sh "$FATTN_AB_OLD" /tmp/fattn_old_tree > "$OUT/old_build.log" 2>&1 &
  OLD_PID=$!
fi
if ! FATTN_CUDA_ARCHS="${FATTN_CUDA_ARCHS:-arch=compute_90,code=sm_90;arch=compute_80,code=sm_80}" \
     python3 setup.py build_ext --inplace >> "$LOG" 2>&1; then
  tail -30 "$LOG"; echo "BUILD FAILED"; exit 1
fi
say "build took $(( $(date +%s) - t0 )) s"
grep "spilled" "$LOG" | grep -v " 0 bytes spill" | sed 's/.*function //' | head -40 >> "$OUT/spills.txt"
# ptxas C7512, C7515-C7520: wgmma serialized or waits injected (too few registers for the function, a wgmma issued
# or awaited under a condition, an accumulator written while a group is open, a group open across a loop's back edge)
if grep -qE "C75(12|1[5-9]|20)" "$LOG"; then
  say "WARNING: ptxas serialized wgmma in: $(grep -E "C75(12|1[5-9]|20)" "$LOG" | sed 's/.*function //' | sort -u | tr '\n' ' ')"
fi
python3 bench/kernel_report.py > "$OUT/kernel_report.md" 2>>"$LOG"

if [ -n "${FATTN_SMOKE:-}" ]; then  # e.g. FATTN_SMOKE=v3: a quick look at one variant; stop here if it fails
  say "smoke $FATTN_SMOKE"
  if ! timeout 120 python3 bench/smoke.py --variant "$FATTN_SMOKE" --mode "${FATTN_SMOKE_MODE:-fwd}" 2>&1 | tee -a "$LOG"; then
    echo "SMOKE FAILED"; exit 1
  fi
fi

say "pytest ${FATTN_PYTEST_ARGS:-}"
# shellcheck disable=SC2086
# FATTN_PYTEST_ARGS is split on spaces; a -k expression with spaces goes in FATTN_PYTEST_K
KARGS=(); [ -n "${FATTN_PYTEST_K:-}" ] && KARGS=(-k "$FATTN_PYTEST_K")
timeout "${FATTN_PYTEST_TIMEOUT:-420}" python3 -m pytest -q -rs -p no:cacheprovider tests ${FATTN_PYTEST_ARGS:-} "${KARGS[@]}" 2>&1 | tee -a "$LOG" | tail -15
PYTEST_RC=${PIPESTATUS[0]}
say "pytest exit code $PYTEST_RC"

VARIANTS=${FATTN_VARIANTS:-$(python3 -c 'import fattn; print(",".join(v for v in fattn.variants("cuda") if v != "v0"))')}
for g in $GRIDS; do
  case $g in
    none)   continue ;;
    seeds)  args=(--grid seeds --variants "v0,$VARIANTS") ;;
    seeds_e2e) args=(--grid seeds --variants "$VARIANTS" --timer batch --reps 200) ;;
    fa3)    args=(--grid fa3 --variants "$VARIANTS" --torch-backends "${FATTN_TORCH_BACKENDS:-flash,efficient,cudnn}" --reps 10 --warmup 2) ;;
    fa3_bf16) args=(--grid fa3 --dtype bf16 --variants "$VARIANTS" --torch-backends "${FATTN_TORCH_BACKENDS:-flash,efficient,cudnn}" --reps 10 --warmup 2) ;;
    decode) args=(--grid decode --variants "$VARIANTS" --torch-backends flash,efficient,cudnn) ;;
    fa3_bwd|fa3_bf16_bwd|fa3_fwdbwd)  # the backward alone (v2, v3 and v3's deterministic mode) / forward + backward
      mode=${g##*_}; dt=fp16; [ "$g" = fa3_bf16_bwd ] && dt=bf16
      bv=${FATTN_BWD_VARIANTS:-v2,v3,v3-det}; [ "$mode" = fwdbwd ] && bv=${FATTN_BWD_VARIANTS:-v2,v3}
      args=(--grid fa3 --mode "$mode" --dtype $dt --variants "$bv" --torch-backends "${FATTN_TORCH_BACKENDS:-flash,cudnn}" --reps 10 --warmup 2) ;;
    cp)  # context parallelism on every GPU of the host; FATTN_CP_ARGS overrides the grid's defaults
      n=$(nvidia-smi -L | wc -l)
      say "bench cp on $n GPUs: ${FATTN_CP_ARGS:-}"
      # shellcheck disable=SC2086
      NCCL_NVLS_ENABLE=0 timeout "${FATTN_CP_TIMEOUT:-400}" torchrun --nproc-per-node="$n" -m fattn.bench --grid cp \
        ${FATTN_CP_ARGS:-} --json "$OUT/cp.json" --plot "$OUT/cp.png" 2>>"$LOG" | tee -a "$LOG"
      continue ;;
    paged)  # decode over a paged KV cache (its own runner)
      say "bench paged"
      python3 -m fattn.bench --grid paged --json "$OUT/paged.json" 2>>"$LOG" | tee -a "$LOG"
      continue ;;
    serving)  # issue 17's timing targets (window, varlen, ragged, packed backward, softcap / ALiBi costs)
      say "bench serving: ${FATTN_SERVING_TARGETS:-all}"
      timeout "${FATTN_SERVING_TIMEOUT:-300}" python3 bench/serving_targets.py --json "$OUT/serving.json" \
        ${FATTN_SERVING_TARGETS:+--targets "$FATTN_SERVING_TARGETS"} 2>>"$LOG" | tee -a "$LOG"
      continue ;;
    *)      args=(--grid "$g" --variants "$VARIANTS") ;;
  esac
  say "bench $g: ${args[*]}"
  python3 -m fattn.bench "${args[@]}" --json "$OUT/$g.json" --md "$MD_DIR/$g.md" 2>>"$LOG" | tee -a "$LOG"
  cat "$MD_DIR/$g.md" >> "$OUT/summary.md" 2>/dev/null
done

if [ -n "$OLD_PID" ]; then
  say "A/B against the older tree ($FATTN_AB_OLD)"
  if wait "$OLD_PID"; then
    for g in ${FATTN_AB_GRIDS:-seeds seeds_e2e fa3 decode}; do
      case $g in  # seeds_e2e: the public call path end to end (back-to-back calls), beside the older tree's
        seeds_e2e) ab=(--candidates api:v2 old:v2 api:v3 old:v3 --grid seeds --timer batch --reps 200) ;;
        fa3_bwd)   ab=(--mode bwd --candidates api:v3 old:v3 api:v3-det old:v3-det --grid fa3 --head-dims "${FATTN_AB_DIMS:-64,128}"
                       --torch cudnn --reps 5) ;;  # v3's backward
        *)         ab=(--candidates v2 old:v2 v3 old:v3 --grid "$g") ;;
      esac
      python3 bench/ab.py --old /tmp/fattn_old_tree "${ab[@]}" --causal both --rounds "${FATTN_AB_ROUNDS:-5}" \
        --json "$OUT/ab_$g.json" 2>&1 | tee -a "$LOG"
    done
  else
    say "the older tree did not build: $(tail -5 "$OUT/old_build.log")"
  fi
fi
if [ "${FATTN_SANITIZE:-0}" = 1 ]; then
  say "compute-sanitizer"
  timeout "${FATTN_SANITIZE_TIMEOUT:-300}" bash bench/sanitize.sh "$OUT" "${FATTN_SANITIZE_TOOLS:-memcheck racecheck}" | tee -a "$LOG"
fi

say "summary: fattn p50 ratio to the best torch backend (>1 = faster), per grid"
python3 - "$OUT" $GRIDS <<'PY'
import json, os, sys
out, grids = sys.argv[1], sys.argv[2:]
for g in grids:
    path = os.path.join(out, g + ".json")
    if not os.path.exists(path):
        continue
    rows = json.load(open(path))["rows"]
    for impl in sorted({r["impl"] for r in rows if r["impl"].startswith("fattn:")}):
        rs = [r for r in rows if r["impl"] == impl and r.get("ratio_vs_best_torch") and r.get("tflops")]
        if not rs: continue
        ratios = [r["ratio_vs_best_torch"] for r in rs]
        best = max(rs, key=lambda r: r["tflops"] or 0)
        print(f"{g:7s} {impl:9s} points={len(rs):3d} ratio min={min(ratios):.3f} max={max(ratios):.3f} "
              f"peak {best['tflops']:.1f} TFLOP/s at B={best['B']} H={best['H']} S={best['Sq']} D={best['D']} causal={best['causal']}")
for name in sorted(os.listdir(out)):
    if not (name.startswith("ab_") and name.endswith(".json")):
        continue
    res = json.load(open(os.path.join(out, name)))["results"]
    for v in ("v2", "v3", "api:v2", "api:v3", "api:v3-det"):
        o = "old:" + v.split(":")[-1]
        sp = [r["median_us"][o] / r["median_us"][v] for r in res if v in r["median_us"] and o in r["median_us"]]
        eq = [r["bitwise_equal_to_old"].get(v) for r in res if v in r["bitwise_equal_to_old"]]
        if sp:
            print(f"{name[3:-5]:7s} {v} new/old speed min={min(sp):.3f} median={sorted(sp)[len(sp)//2]:.3f} max={max(sp):.3f} "
                  f"points={len(sp)} bitwise equal {sum(1 for e in eq if e)}/{len(eq)}")
PY
echo "pytest exit code: $PYTEST_RC"
exit $PYTEST_RC
