#!/usr/bin/env bash
# One device call on the H200: run (or resume) an experiment from a git bundle of this repository,
# then send back the report and either the records for the next call or, on the last call, the
# records to keep.
#
# Here, before the call:
#   make h200-wheels                                   # .whl/ (ignored)
#   mkdir -p .bundle && git bundle create .bundle/repo.bundle --branches   # the device copy has no .git; candidate branches ride along
#   # an experiment on another repository: its bundle beside, .bundle/<name>.bundle, is cloned into
#   # targets/<name> of the device's checkout (every branch); for fla: bash tools/fla_target.sh
#   # after an unfinished call: rm -rf .carry && mkdir .carry && cp /work/.device/<n>/state.tgz.* .carry/
# The call (device tool): command "bash tools/h200_session.sh pkda-dAqk 480 [harness run args...]",
#   carry [".whl", ".bundle", ".carry"], timeout_s 600. EXP is a name under experiments/ or the
#   path of an experiment file in this repository (its file name is the experiment's name).
# A call that finds the last call's machine still warm (the next call made within its idle time)
#   reuses that machine's /tmp/repo whole when it holds the same commit, and ignores .carry.
# Env knobs: RUN_ID (default the card's model, h100 or h200: the pool lends either, and a run is
#   resumed only on the card model it started on); WARM_ARGS (e.g. --no-fixtures once freeze/verify are done);
#   ALSO_WARM="exp ..." also compiles those experiments' kernels beside this warm (for the next
#   call on the same machine), finished before this run's first timed block;
#   CAPTURE=1 also captures the small ncu test fixtures (tools/capture_ncu_fixtures.sh) while the
#   kernels compile, before any timed block; FINAL=1 sends records.tgz (the run's JSON records
#   and logs, the run's ncu reports if small) instead of resumable state; a run that reached its
#   verdict always comes back that way.
# What comes back in $OUT: run.log, report.json + index.html when the run finished, and
# state.tgz.aa, .ab, ... (this experiment's records: its run, freeze/verify/profile JSON, the
# Triton caches or their autotune results, the bench-base branch freeze made for it in each
# repository; no worktrees, ncu reports or fixture tensors; packed by tools/h200_pack.sh inside
# the device's limits) to put in .carry/ for `--resume` in the next call.
set -u
EXP=${1:?experiment name or file}
BUDGET=${2:-480}        # seconds for `harness warm` + `harness run`; the rest of the call packs results
shift 2 || true
RUN_ARGS=("$@")
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE '[A-Z][0-9]{2,4}' | head -1 | tr 'A-Z' 'a-z')
RUN_ID=${RUN_ID:-${CARD:-gpu}}
HERE=$PWD
exp_file() { case "$1" in *.yaml) echo "$1" ;; *) echo "experiments/$1.yaml" ;; esac; }
EXP_FILE=$(exp_file "$EXP")
NAME=$(basename "$EXP_FILE" .yaml)
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HARNESS_QUIET=1
WANT=$(git ls-remote "$HERE/.bundle/repo.bundle" refs/heads/main | cut -f1)
RESUME=()
if [ -d /tmp/repo/.git ] && [ "$(git -C /tmp/repo rev-parse HEAD)" = "$WANT" ]; then
  # the machine is still the one of the last call (it stayed warm): its records, worktrees, Triton
  # cache and ncu reports are all here, newer than anything in .carry
  cd /tmp/repo && echo "reusing this machine's /tmp/repo ($(du -sh results 2>/dev/null | cut -f1) of records)"
  RESTORED=0
else
  rm -rf /tmp/repo && git clone -q "$HERE/.bundle/repo.bundle" /tmp/repo && cd /tmp/repo && git checkout -q main || exit 2
  RESTORED=1
fi
export HARNESS_RESULTS=$PWD/results   # the results root of every harness command below
# every other bundle is a target repository: targets/<name>, all its branches (fetched again on a
# reused machine: a moved candidate branch must be seen; bench-base/* made here are kept)
for b in "$HERE"/.bundle/*.bundle; do
  t=$(basename "$b" .bundle); [ "$t" = repo ] && continue
  [ -d "targets/$t/.git" ] || git init -q "targets/$t"
  git -C "targets/$t" fetch -q "$b" '+refs/heads/*:refs/heads/*' && echo "targets/$t: $(git -C "targets/$t" branch | wc -l) branches"
done
if [ "$RESTORED" = 1 ] && ls "$HERE"/.carry/state.tgz.* >/dev/null 2>&1; then
  cat "$HERE"/.carry/state.tgz.* | tar xzf - && echo "restored $(du -sh results | cut -f1) of records"
  for b in results/bench-base/*.bundle; do   # the oracle branches freeze made on an earlier machine
    [ -f "$b" ] || continue; t=$(basename "$b" .bundle); r=$([ "$t" = repo ] && echo . || echo "targets/$t")
    git -C "$r" fetch -q "$PWD/$b" '+refs/heads/bench-base/*:refs/heads/bench-base/*' && echo "bench-base branches of $r restored"
  done
fi
[ -d "results/profile/$NAME/runs/$RUN_ID" ] && RESUME=(--resume)
git log --oneline -1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,clocks_event_reasons.active --format=csv,noheader
START=$(date +%s)
CAPTURE_PID=
if [ "${CAPTURE:-0}" = 1 ]; then
  # compiles on the CPU beside the warm below; its two ncu passes end before any timed block starts
  OUT="$OUT/ncu-fixtures" PY=python3 bash tools/capture_ncu_fixtures.sh > /tmp/capture.log 2>&1 &
  CAPTURE_PID=$!
fi
# compile every kernel in parallel first (minutes on a fresh machine, seconds with a carried cache)
mkdir -p "results/profile/$NAME"
WARM_LOG=results/profile/$NAME/warm-$(date -u +%Y%m%dT%H%M%SZ).log   # travels with the state (8 files come back at most)
ALSO_PIDS=()
for other in ${ALSO_WARM:-}; do
  # the next call's experiment compiles beside this one's warm (CPU-bound); waited for below,
  # so no compile runs during a timed block
  other_file=$(exp_file "$other"); other_name=$(basename "$other_file" .yaml)
  mkdir -p "results/profile/$other_name"
  timeout "$BUDGET" python3 -m harness warm "$other_file" > "results/profile/$other_name/warm-$(date -u +%Y%m%dT%H%M%SZ).log" 2>&1 &
  ALSO_PIDS+=($!)
done
timeout "$BUDGET" python3 -m harness warm "$EXP_FILE" ${WARM_ARGS:-} > "$WARM_LOG" 2>&1
echo "harness warm rc=$? in $(( $(date +%s) - START )) s"; tail -3 "$WARM_LOG"
for pid in "${ALSO_PIDS[@]}"; do wait "$pid"; echo "warm of ALSO_WARM (pid $pid) rc=$? at $(( $(date +%s) - START )) s"; done
[ "${FINAL:-0}" = 1 ] && cp "$WARM_LOG" "$OUT/warm.log"
if [ -n "$CAPTURE_PID" ]; then
  wait "$CAPTURE_PID"; echo "ncu fixture capture rc=$? at $(( $(date +%s) - START )) s"; grep -E "rc=|MISSING" /tmp/capture.log | tail -4
fi
BUDGET=$(( BUDGET - ($(date +%s) - START) ))
timeout "$BUDGET" python3 -m harness run "$EXP_FILE" --run-id "$RUN_ID" "${RESUME[@]}" "${RUN_ARGS[@]}" \
  > "$OUT/run.log" 2>&1
rc=$?
echo "harness run rc=$rc"; tail -15 "$OUT/run.log"
REPORT=results/reports/$NAME/$RUN_ID
if [ -f "$REPORT/report.json" ] && [ "$rc" != 124 ]; then
  cp "$REPORT/report.json" "$REPORT/index.html" "$OUT/"
else
  timeout 60 python3 -m harness report "$EXP_FILE" --run "$RUN_ID" >/dev/null 2>&1 && \
    cp "$REPORT/report.json" "$REPORT/index.html" "$OUT/"
fi
# the bench-base branch freeze made for this experiment, in each repository, travels with the
# results root: only its own commits (the fixtures), on top of what the carried bundles hold already
mkdir -p results/bench-base
for r in . targets/*; do
  [ -d "$r/.git" ] || continue
  keep=$(git -C "$r" for-each-ref --format='%(refname)' "refs/heads/bench-base/$NAME")
  have=$(git -C "$r" for-each-ref --format='^%(refname)' refs/heads/ refs/remotes/ | grep -v '^^refs/heads/bench-base/')
  b="$PWD/results/bench-base/$([ "$r" = . ] && echo repo || basename "$r").bundle"
  rm -f "$b"   # an earlier experiment's on a reused machine
  [ -n "$keep" ] && git -C "$r" bundle create -q "$b" $keep $have
done
. "$HERE/tools/h200_pack.sh"
# a run that reached its verdict (exit 0 GO, 1 NO-GO, 3 INCONCLUSIVE) has nothing to resume: its
# records come back as on a last call (on 2026-12-07 packing 2 GB of resumable state for a finished
# run took a call past its limit)
case "$rc" in
  0|1|3) if [ "${FINAL:-0}" != 1 ]; then
           echo "the run is finished: sending its records (as FINAL=1)"; cp "$WARM_LOG" "$OUT/warm.log"; FINAL=1
         fi ;;
esac
if [ "${FINAL:-0}" = 1 ]; then
  # the records to keep (never into git: they go to the results root here): the run dir,
  # freeze/verify/profile JSON, attempts, the report; the run's ncu reports when they fit
  pack_records "$NAME" "$OUT"
  find results -path "*/$NAME/*" -name '*.ncu-rep' -exec ls -la {} \;
  ls -la "$OUT" "$OUT"/ncu-fixtures 2>/dev/null
  exit 0
fi
# records for the next call, inside what this call may still send back: 8 files and 64 MiB in
# all, less what $OUT holds already (the report, logs, ncu fixtures); or, when set, ROOM_FILES
# and ROOM_BYTES for the state pieces alone (tools/h200_sessions.sh, which copies only run.log
# and the pieces and keeps room for its later experiments)
if [ -n "${ROOM_FILES:-}" ]; then
  pack_state "$NAME" "$OUT" "$ROOM_FILES" "${ROOM_BYTES:?ROOM_BYTES comes with ROOM_FILES}"
else
  pack_state "$NAME" "$OUT" $(( 8 - $(find "$OUT" -type f | wc -l) )) $(( 67108864 - $(du -sb "$OUT" | cut -f1) ))
fi
du -sh results/profile/triton-cache 2>/dev/null
ls -la "$OUT"
