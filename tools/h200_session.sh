#!/usr/bin/env bash
# One device call on the H200: run (or resume) an experiment from a git bundle of this repository,
# then send back the report and, when the run did not finish, its records for the next call.
#
# Here, before the call:
#   make h200-wheels                                   # .whl/ (ignored)
#   mkdir -p .bundle && git bundle create .bundle/repo.bundle main   # the device copy has no .git
#   # after an unfinished call: mkdir -p .carry && cp /work/.device/<n>/state.tgz.* .carry/
# The call (device tool): command "bash tools/h200_session.sh pkda-dAqk 480",
#   carry [".whl", ".bundle", ".carry"], timeout_s 600.
# What comes back in $OUT: warm.log, run.log, report.json + index.html when the run finished, and
# state.tgz.aa, .ab, ... (records, verify/profile/ncu JSON, Triton caches with autotune timings;
# no worktrees, no ncu reports) to put in .carry/ for `--resume` in the next call.
set -u
EXP=${1:?experiment name}
BUDGET=${2:-480}        # seconds for `harness run` itself; the rest of the call packs results
RUN_ID=${RUN_ID:-h200}
HERE=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HARNESS_QUIET=1
rm -rf /tmp/repo && git clone -q "$HERE/.bundle/repo.bundle" /tmp/repo && cd /tmp/repo && git checkout -q main || exit 2
git log --oneline -1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,clocks_event_reasons.active --format=csv,noheader
RESUME=()
if ls "$HERE"/.carry/state.tgz.* >/dev/null 2>&1; then
  cat "$HERE"/.carry/state.tgz.* | tar xzf - && echo "restored $(du -sh profile | cut -f1) of records"
  [ -d "profile/$EXP/runs/$RUN_ID" ] && RESUME=(--resume)
fi
START=$(date +%s)
# compile every kernel in parallel first (minutes on a fresh machine, seconds with a carried cache)
timeout "$BUDGET" python3 -m harness warm "experiments/$EXP.yaml" > "$OUT/warm.log" 2>&1
echo "harness warm rc=$? in $(( $(date +%s) - START )) s"; tail -3 "$OUT/warm.log"
BUDGET=$(( BUDGET - ($(date +%s) - START) ))
timeout "$BUDGET" python3 -m harness run "experiments/$EXP.yaml" --run-id "$RUN_ID" "${RESUME[@]}" > "$OUT/run.log" 2>&1
rc=$?
echo "harness run rc=$rc"; tail -15 "$OUT/run.log"
REPORT=reports/$EXP/$RUN_ID
if [ -f "$REPORT/report.json" ] && [ "$rc" != 124 ]; then
  cp "$REPORT/report.json" "$REPORT/index.html" "$OUT/"
else
  timeout 60 python3 -m harness report "experiments/$EXP.yaml" --run "$RUN_ID" >/dev/null 2>&1 && \
    cp "$REPORT/report.json" "$OUT/partial-report.json"
fi
# records for the next call: <= 15 MB a piece; at most 8 files come back, so at most 4 pieces. The
# Triton caches go whole when they fit, else only their autotune results (*.autotune.json: the next
# machine then compiles the chosen configs but benchmarks none).
tar czf - --exclude=worktrees --exclude='*.ncu-rep' profile | split -b 15m - /tmp/state-full.
n=$(ls /tmp/state-full.* | wc -l)
if [ "$n" -le 4 ]; then
  for f in /tmp/state-full.*; do mv "$f" "$OUT/state.tgz.${f##*.}"; done
else
  echo "state is $n pieces with the Triton caches: sending their autotune results only"
  find profile -path '*/triton-cache/*' -type f ! -name '*.autotune.json' > /tmp/drop.txt
  tar czf - --exclude=worktrees --exclude='*.ncu-rep' --exclude-from=/tmp/drop.txt profile | split -b 15m - "$OUT/state.tgz."
fi
du -sh profile/*/triton-cache 2>/dev/null
ls -la "$OUT"
