# What one experiment's device call sends back, inside the device's limits on files back from $OUT
# (8 files, 16 MiB each, 64 MiB together: /work/.library/device/README.md). Sourced by
# tools/h200_session.sh (run from the device checkout's results root's parent); tested by
# tests/test_h200_pack.py.
#
#   pack_records NAME OUT                         a finished run: OUT/records.tgz
#   pack_state NAME OUT ROOM_FILES ROOM_BYTES     an unfinished one: OUT/state.tgz.aa, .ab, ...
#
# Only NAME's own records travel: on a machine reused by tools/h200_sessions.sh the results root
# also holds the earlier experiments' (on 2026-12-08 one state carried another experiment's 58 MB
# of fixture tensors and came to 6 pieces, 88 MB: over the 64 MiB a call returns, so two pieces and
# the next experiment's records stayed behind). Fixture tensors are left out too: the frozen ones
# live in the bench-base branch (its bundle travels), and the copies under freeze/ and verify/ are
# scratch once freeze.json and verify.json are written.
PACK_PIECE_BYTES=$((15 * 1024 * 1024))

_pack_paths() {   # NAME -> the results paths a resume or a publish of NAME reads
  local p
  for p in "results/profile/$1" "results/reports/$1" results/profile/triton-cache results/bench-base; do
    [ -e "$p" ] && echo "$p"
  done
}

pack_records() {
  local name=$1 out=$2 paths
  mapfile -t paths < <(_pack_paths "$name" | grep -v -e triton-cache -e bench-base)
  local keep=(--exclude=worktrees --exclude='*.safetensors')
  tar czf /tmp/records.tgz "${keep[@]}" "${paths[@]}"
  if [ "$(stat -c %s /tmp/records.tgz)" -gt "$PACK_PIECE_BYTES" ]; then   # the ncu reports stay behind
    tar czf /tmp/records.tgz "${keep[@]}" --exclude='*.ncu-rep' "${paths[@]}"
  fi
  local size; size=$(stat -c %s /tmp/records.tgz)
  if [ "$size" -gt "$PACK_PIECE_BYTES" ]; then
    echo "pack: RECORDS DO NOT FIT: records.tgz is $size bytes, one file may be $PACK_PIECE_BYTES; not sent"
    return 1
  fi
  mv /tmp/records.tgz "$out/records.tgz"
  echo "pack: records.tgz $size bytes ($name's records)"
}

pack_state() {
  local name=$1 out=$2 room_files=$3 room_bytes=$4 paths
  mapfile -t paths < <(_pack_paths "$name")
  local scratch=(--exclude=worktrees --exclude='*.ncu-rep' --exclude='*.safetensors')
  local max=$(( room_bytes / PACK_PIECE_BYTES ))
  [ "$room_files" -lt "$max" ] && max=$room_files
  rm -f /tmp/state-piece.*
  local raw; raw=$(du -scb "${scratch[@]}" "${paths[@]}" | tail -1 | cut -f1)
  local n=999
  # the Triton caches compress ~6.5x (126 MB -> 19 MB); a tree that cannot fit is not compressed
  # at all (on 2026-12-03 a 1.2 GB tar took a call past its limit)
  if [ "$raw" -le $(( max * 45000000 )) ]; then
    timeout 120 tar czf - "${scratch[@]}" "${paths[@]}" | split -b "$PACK_PIECE_BYTES" - /tmp/state-piece.
    [ "${PIPESTATUS[0]}" = 0 ] && n=$(ls /tmp/state-piece.* | wc -l)   # a tar cut short leaves pieces that cannot resume
  fi
  echo "pack: state $raw bytes uncompressed, $n pieces with the Triton caches; room for $max"
  if [ "$n" -gt "$max" ]; then   # the Triton caches' autotune results only: the next machine compiles the chosen configs, benchmarks none
    rm -f /tmp/state-piece.*
    find results -path '*/triton-cache/*' -type f ! -name '*.autotune.json' > /tmp/pack-drop.txt
    tar czf - "${scratch[@]}" --exclude-from=/tmp/pack-drop.txt "${paths[@]}" | split -b "$PACK_PIECE_BYTES" - /tmp/state-piece.
    n=$(ls /tmp/state-piece.* | wc -l)
    echo "pack: state without the Triton caches' binaries: $n pieces"
  fi
  if [ "$n" -gt "$max" ]; then
    rm -f /tmp/state-piece.*
    echo "pack: STATE DOES NOT FIT ($n pieces of 15 MiB, room for $max): not sent; only this machine can resume the run, while it stays warm"
    return 1
  fi
  local f
  for f in /tmp/state-piece.*; do mv "$f" "$out/state.tgz.${f##*.}"; done
}
