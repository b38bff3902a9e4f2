#!/usr/bin/env bash
# Several experiments in one device call: one machine start and one parallel compile for all of
# them, then tools/h200_session.sh for each in turn on that machine.
#
#   bash tools/h200_sessions.sh EXP1:BUDGET1 EXP2:BUDGET2 [...]
#
# (device tool: carry [".whl", ".bundle"], timeout_s 600). BUDGET is each experiment's seconds for
# `harness warm` + `harness run` as in h200_session.sh; the first one's warm also compiles every
# later experiment's kernels (ALSO_WARM), so the later ones start measuring at once. The budgets
# and the packing after each must fit the call's 600 s: two single-step runs of two rows
# (a warm ~2 min, each run ~2-3.5 min) are what one call holds.
#
# What comes back: $OUT/<n>-<exp>/run.log and records.tgz (a finished run) or state.tgz.* (an
# unfinished one, to resume with h200_session.sh as its header says). The device returns at most
# 8 files, so each experiment keeps only those: its report.json, index.html and warm log are
# inside records.tgz (results/reports/<exp>/<run id>/, results/profile/<exp>/).
set -u
[ $# -ge 1 ] || { echo "usage: bash tools/h200_sessions.sh EXP:BUDGET [EXP:BUDGET ...]" >&2; exit 2; }
FINAL_OUT=${OUT:?the device call sets OUT}
names=()
budgets=()
for arg in "$@"; do
  case "$arg" in
    *:[0-9]*) names+=("${arg%%:*}"); budgets+=("${arg##*:}") ;;
    *) echo "h200_sessions.sh: '$arg' is not EXP:BUDGET (e.g. pkda-atk-tc:300)" >&2; exit 2 ;;
  esac
done
for i in "${!names[@]}"; do
  exp=${names[$i]}
  later=("${names[@]:$((i + 1))}")
  scratch=/tmp/out-$i
  rm -rf "$scratch" && mkdir -p "$scratch"
  echo "=== $exp (budget ${budgets[$i]} s) ==="
  # the state pieces' room: what the device still returns, less this run's log (1 file, ~1 MiB)
  # and 2 files / 16 MiB for each later experiment (its log and records); on 2026-12-08 a state
  # took all the room and the next experiment's finished records stayed behind
  room_files=$(( 8 - $(find "$FINAL_OUT" -type f | wc -l) - 1 - 2 * ${#later[@]} ))
  room_bytes=$(( 67108864 - $(du -sb "$FINAL_OUT" | cut -f1) - 1048576 - 16777216 * ${#later[@]} ))
  if [ "$i" = 0 ]; then
    OUT=$scratch ROOM_FILES=$room_files ROOM_BYTES=$room_bytes ALSO_WARM="${later[*]:-}" \
      bash tools/h200_session.sh "$exp" "${budgets[$i]}"
  else
    OUT=$scratch ROOM_FILES=$room_files ROOM_BYTES=$room_bytes bash tools/h200_session.sh "$exp" "${budgets[$i]}"
  fi
  dest="$FINAL_OUT/$i-$(basename "$exp" .yaml)"
  mkdir -p "$dest"
  cp "$scratch/run.log" "$dest/" 2>/dev/null
  if [ -f "$scratch/records.tgz" ]; then
    cp "$scratch/records.tgz" "$dest/"
  else
    cp "$scratch"/state.tgz.* "$dest/" 2>/dev/null
  fi
  ls -la "$dest"
done
echo "files back: $(find "$FINAL_OUT" -type f | wc -l) (the device returns 8 at most)"
