#!/usr/bin/env bash
# fla's public PKDA test file (tests/ops/test_precond_kda.py of an fla clone), unmodified, against
# this repository's chunk_precond_kda and fused_recurrent_precond_kda: fla's naive reference,
# tolerances and conftest (with its NaN-poisoned allocations, extended to ours) are kept; only the
# two ops are swapped, by the pytest plugin tools/fla_public_plugin.py, before collection.
#
#   bash tools/fla_public_tests.sh FLA [BUDGET_S]
#
# FLA       an fla clone, or a git bundle of fla (cloned to /tmp/fla-public-clone, branch
#           seed-baseline), e.g. .bundle/fla-seed-27967b97.bundle carried to the GPU machine
# BUDGET_S  wall seconds for the shards (default 450); each test also gets pytest-timeout's
#           --timeout=TEST_TIMEOUT_S (default 240) when pytest-timeout is importable
#
# The tests run in parallel shards (-k groups of the file, below), one pytest process each, on the
# machine's GPUs in turn: on a fresh machine most of the time is Triton compiling and autotuning
# (CPU-bound, one process at a time), so shards that need different kernels overlap it. A
# collect-only pass beside them lists every test, so one that no shard ran shows up as "not run".
# Run from this repository's root. Needs python3 with torch, triton, einops, pytest; missing pytest,
# pytest-timeout (or their dependencies, or einops) are installed from .whl/ when its wheels are
# there (make h200-wheels; carry .whl).
# Writes to $OUT (default ./fla-public-out): summary.txt (counts, then every test: outcome,
# seconds, first line of the failure, tolerance warnings), results.jsonl (every shard's records,
# as they came), logs.txt (each shard's last 60 lines). Exit code: 0 when every test passed.
set -u
FLA=${1:?usage: bash tools/fla_public_tests.sh FLA_CLONE_OR_BUNDLE [BUDGET_S]}
BUDGET=${2:-450}
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUTDIR=${OUT:-$PWD/fla-public-out}
WORK=/tmp/fla-public-run
rm -rf "$WORK" && mkdir -p "$WORK" "$OUTDIR"

if [ -f "$FLA" ]; then
  rm -rf /tmp/fla-public-clone
  git clone -q -b seed-baseline "$FLA" /tmp/fla-public-clone || { echo "cannot clone $FLA"; exit 2; }
  FLA=/tmp/fla-public-clone
fi
FLA=$(cd "$FLA" && pwd)
TEST_FILE=tests/ops/test_precond_kda.py
[ -f "$FLA/$TEST_FILE" ] || { echo "$FLA has no $TEST_FILE"; exit 2; }

# test-only packages the machine lacks, from carried wheels (never the fla-core wheel: the clone's
# fla must be the only one)
SITE=/tmp/fla-public-site
WHEELS=()
for spec in pytest:pytest-[0-9] pluggy:pluggy- iniconfig:iniconfig- packaging:packaging- \
            pygments:pygments- pytest_timeout:pytest_timeout- einops:einops-; do
  mod=${spec%%:*}; prefix=${spec#*:}
  if ! python3 -c "import $mod" 2>/dev/null; then
    whl=$(ls "$REPO"/.whl/"$prefix"*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] && WHEELS+=("$whl")
  fi
done
if [ ${#WHEELS[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --target "$SITE" "${WHEELS[@]}" || exit 2
fi
export PYTHONPATH="$FLA:$REPO:$REPO/tools:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset FLA_CI_ENV   # fla's assert_close only warns on most tolerance breaches when it is 1
for mod in pytest einops torch triton; do
  python3 -c "import $mod" 2>/dev/null || { echo "python3 cannot import $mod (carry its wheel in .whl/)"; exit 2; }
done
FLA_FOUND=$(cd /tmp && python3 -c "import importlib.util as u; print(u.find_spec('fla').submodule_search_locations[0])" 2>&1)
[ "$FLA_FOUND" = "$FLA/fla" ] || { echo "python3 imports fla from $FLA_FOUND, not from $FLA"; exit 2; }
TIMEOUT_ARGS=()
# pytest-timeout registers itself through its entry point when installed
python3 -m pytest --help -p no:cacheprovider 2>/dev/null | grep -q -- "--timeout=" && \
  TIMEOUT_ARGS=(--timeout="${TEST_TIMEOUT_S:-240}")

# -k groups: together every test of the file once (the collect-only pass checks that none is
# left out). The test_chunk cases are split by head dim: K64/K60 and K100/K128 compile different
# kernels.
SHARDS=(
  "test_naive_chunk"
  "test_fused_recurrent"
  "test_chunk and not varlen and not transpose and not A_state and (K64- or K60-)"
  "test_chunk and not varlen and not transpose and not A_state and (K100- or K128-)"
  "test_chunk_transpose_state or test_chunk_A_state"
  "test_chunk_varlen and not prefill"
  "test_chunk_varlen_prefill"
  "test_gate"
)
# CPU dry run only (no GPU; TRITON_INTERPRET=1): ONLY="B1-T64 or B1-T63" narrows every shard, and
# FLA_DEVICE_CPU=1 makes fla's tests place their tensors on the CPU (tools/fla_public_plugin.py)
ONLY=${ONLY:-}
DRY=()
[ "${FLA_DEVICE_CPU:-0}" = 1 ] && DRY=(--fla-device-cpu)
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${NGPU:-0}" -ge 1 ] || NGPU=1
{
  echo "fla: $(git -C "$FLA" rev-parse HEAD 2>/dev/null || echo unknown) ($FLA)"
  echo "ours: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo "${REPO_COMMIT:-unknown (no .git; set REPO_COMMIT)}")"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "shards: ${#SHARDS[@]} on $NGPU GPU(s), budget ${BUDGET} s, per-test timeout: ${TIMEOUT_ARGS[*]:-none (no pytest-timeout)}${ONLY:+, only: $ONLY}${DRY[*]:+, ${DRY[*]}}"
} > "$WORK/header.txt"
cat "$WORK/header.txt"

START=$(date +%s)
cd "$FLA"
timeout "$BUDGET" python3 -m pytest "$TEST_FILE" -p fla_public_plugin --collect-only -q \
  -p no:cacheprovider "${DRY[@]}" --fla-report "$WORK/collect.jsonl" > "$WORK/collect.log" 2>&1 &
COLLECT_PID=$!
PIDS=()
for i in "${!SHARDS[@]}"; do
  CUDA_VISIBLE_DEVICES=$(( i % NGPU )) timeout "$BUDGET" python3 -m pytest "$TEST_FILE" \
    -p fla_public_plugin --fla-report "$WORK/shard-$i.jsonl" -k "(${SHARDS[$i]})${ONLY:+ and ($ONLY)}" \
    -rf -q -o log_cli=false -p no:cacheprovider "${TIMEOUT_ARGS[@]}" "${DRY[@]}" > "$WORK/shard-$i.log" 2>&1 &
  PIDS+=($!)
done
wait "$COLLECT_PID"
RCS=()
for i in "${!PIDS[@]}"; do
  wait "${PIDS[$i]}"; rc=$?
  RCS+=("$rc")
  echo "shard $i rc=$rc at $(( $(date +%s) - START )) s: ${SHARDS[$i]}"
done
cd "$REPO"

# one collected list (from the collect-only pass), every shard's results
cat "$WORK"/collect.jsonl "$WORK"/shard-*.jsonl > "$OUTDIR/results.jsonl" 2>/dev/null
{
  cat "$WORK/header.txt"
  for i in "${!SHARDS[@]}"; do
    echo "shard $i rc=${RCS[$i]}$([ "${RCS[$i]}" = 124 ] && echo ' (killed at the budget)'): -k \"${SHARDS[$i]}\""
  done
  echo "wall: $(( $(date +%s) - START )) s"
  echo
  python3 tools/fla_public_plugin.py summarise "$OUTDIR/results.jsonl" 2>&1
} > "$OUTDIR/summary.txt"
for i in "${!SHARDS[@]}"; do
  echo "===== shard $i rc=${RCS[$i]}: -k \"${SHARDS[$i]}\""; tail -60 "$WORK/shard-$i.log"
done > "$OUTDIR/logs.txt"
echo "===== collect-only" >> "$OUTDIR/logs.txt"; tail -20 "$WORK/collect.log" >> "$OUTDIR/logs.txt"
cat "$OUTDIR/summary.txt"
grep -q "^fla public PKDA tests.*collected; [0-9]* passed$" "$OUTDIR/summary.txt"
