#!/usr/bin/env bash
# Stop what slurm-up.sh started, each daemon by its own PID (no pkill/killall).
# A cluster shared by several callers (see slurm-up.sh) stops only when the caller ($PPID) was
# its last live holder; SLURM_CI_FORCE=1 stops it regardless (the tests' accounting restart).
set -u
BASE=${SLURM_CI_DIR:-/tmp/slurm-ci}
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ "${SLURM_CI_FORCE:-0}" != 1 ] && [ -s "$BASE/holders" ]; then
  left=""
  while read -r pid; do
    [ -n "$pid" ] && [ "$pid" != "$PPID" ] && kill -0 "$pid" 2>/dev/null && left+="$pid"$'\n'
  done < "$BASE/holders"
  if [ -n "$left" ]; then
    printf '%s' "$left" > "$BASE/holders"
    echo "slurm still used by $(echo $left | tr '\n' ' '); left running"
    exit 0
  fi
fi
stop_pid() {  # name pidfile
  local name=$1 f=$2 pid
  [ -s "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then echo "$name ($pid) ignored SIGTERM, SIGKILL"; kill -9 "$pid"; fi
    echo "$name ($pid) stopped"
  fi
  rm -f "$f"
}
# cancel jobs first: slurmstepd and job processes outlive slurmd otherwise
if alive "$BASE/slurmctld.pid"; then
  timeout 10 squeue -h -o %A 2>/dev/null | xargs -r timeout 10 scancel --quiet 2>/dev/null || true
  for i in $(seq 1 50); do [ -z "$(timeout 10 squeue -h -t R,CG -o %A 2>/dev/null)" ] && break; sleep 0.2; done
fi
stop_pid slurmd    "$BASE/slurmd.pid"
stop_pid slurmctld "$BASE/slurmctld.pid"
stop_pid slurmdbd  "$BASE/slurmdbd.pid"
stop_pid mariadbd  /run/mysqld/mariadb.pid
stop_pid munged    /run/munge/munged.pid
rm -f "$BASE/holders"
exit 0
