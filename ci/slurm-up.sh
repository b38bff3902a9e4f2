#!/usr/bin/env bash
# Start a throw-away single-node Slurm cluster from Debian 12 packages (CI and the Slurm tests).
# Run as root. Installs what is missing; wipes and recreates all Slurm state on a fresh start.
# Recipe and pitfalls: ../shared/notes/slurm.md.
#   SLURM_CI_DIR         state/log/pid dir                         (default /tmp/slurm-ci)
#   SLURM_CI_CPUS        CPU slots to advertise                     (default nproc; > nproc => config_overrides)
#   SLURM_CI_GPUS        fake GPUs as gres/gpu (char devices)       (default 0)
#   SLURM_CI_ACCOUNTING  1 => MariaDB + slurmdbd, so sacct works    (default 0)
#   SLURM_CI_TIMEOUT     seconds to wait for each daemon            (default 60)
# Sharing: when a healthy cluster is already running (another `make test` in the same machine),
# this script does not restart it; it registers the caller ($PPID) as a holder and exits 0, and
# slurm-down.sh only stops the cluster once no live holder is left (or with SLURM_CI_FORCE=1).
set -euo pipefail
BASE=${SLURM_CI_DIR:-/tmp/slurm-ci}
CONF=/etc/slurm/slurm.conf          # default path: sbatch/squeue/... need no SLURM_CONF
NODE=$(hostname -s)
CPUS=${SLURM_CI_CPUS:-$(nproc)}
GPUS=${SLURM_CI_GPUS:-0}
ACCT=${SLURM_CI_ACCOUNTING:-0}
WAIT=${SLURM_CI_TIMEOUT:-60}
T0=$(date +%s.%N)
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
tries() { echo $(( WAIT * 10 )); }   # polls of 0.1 s
for v in CPUS GPUS ACCT WAIT; do
  [[ ${!v} =~ ^[0-9]+$ ]] || { echo "slurm-up: SLURM_CI_$v must be a non-negative integer, got '${!v}'" >&2; exit 2; }
done

# --- 0. already running? share it ---------------------------------------------
if alive "$BASE/slurmctld.pid" || alive "$BASE/slurmd.pid"; then
  st=$(timeout 10 sinfo -h -N -n "$NODE" -o %t 2>/dev/null || true)
  if alive "$BASE/slurmctld.pid" && alive "$BASE/slurmd.pid" && [[ $st =~ ^(idle|mix|alloc) ]]; then
    echo "$PPID" >> "$BASE/holders"
    echo "slurm already running from $BASE (node $st); sharing it (holder $PPID)"
    exit 0
  fi
  echo "slurm half-running from $BASE (node state '$st'); run SLURM_CI_FORCE=1 ci/slurm-down.sh first" >&2
  exit 1
fi

# --- 1. install (skipped when already installed) ---------------------------
PKGS="slurmctld slurmd slurm-client munge"
[ "$ACCT" = 1 ] && PKGS+=" slurmdbd mariadb-server"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing+=" $p"; done
if [ -n "$missing" ]; then
  export DEBIAN_FRONTEND=noninteractive
  timeout 300 apt-get update -qq
  # shellcheck disable=SC2086
  timeout 600 apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# --- 2. munge (run as user munge; root is refused: log file owned by munge) --
if [ ! -s /etc/munge/munge.key ]; then            # package postinst normally makes it
  mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key; chmod 0600 /etc/munge/munge.key
fi
install -d -o munge -g munge -m 0755 /run/munge
if ! alive /run/munge/munged.pid; then
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged --force     # forks, writes /run/munge/munged.pid
fi
for i in $(seq 1 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n | unmunge >/dev/null                       # fail loudly if munge is unusable

# --- 3. config (fresh state: job ids restart at 1) ---------------------------
rm -rf "$BASE"; mkdir -p "$BASE"/{state,spool,log}
echo "$PPID" > "$BASE/holders"
MEM=$(( $(awk '/^MemTotal:/{print int($2/1024)}' /proc/meminfo) - 1024 ))  # > real => node INVAL
DEFMEM=$(( MEM / CPUS / 2 ))   # no DefMemPerCPU => every job gets ALL node memory => 1 job at a time
EXTRA=""
[ "$CPUS" -gt "$(nproc)" ] && EXTRA+="SlurmdParameters=config_overrides"$'\n'
GRES=""
rm -f /etc/slurm/gres.conf
if [ "$GPUS" -gt 0 ]; then
  # gres File= must be a char/block device (regular files are rejected); c 1 3 = same as /dev/null.
  # Never under /dev: fake /dev/nvidia* would confuse other tools.
  for ((g=0; g<GPUS; g++)); do mknod "$BASE/fakegpu$g" c 1 3; done
  echo "NodeName=$NODE Name=gpu File=$BASE/fakegpu[0-$((GPUS-1))]" > /etc/slurm/gres.conf
  EXTRA+="GresTypes=gpu"$'\n'; GRES="Gres=gpu:$GPUS"
fi
if [ "$ACCT" = 1 ]; then
  EXTRA+="AccountingStorageType=accounting_storage/slurmdbd"$'\n'
  EXTRA+="AccountingStorageHost=localhost"$'\n'"AccountingStoragePort=6819"$'\n'
  EXTRA+="JobAcctGatherType=jobacct_gather/linux"$'\n'
else
  EXTRA+="AccountingStorageType=accounting_storage/none"$'\n'
  EXTRA+="JobAcctGatherType=jobacct_gather/none"$'\n'
fi
mkdir -p /etc/slurm
cat > "$CONF" <<CONF
# written by ci/slurm-up.sh: a throw-away CI cluster; do not edit
ClusterName=ci
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool
SlurmctldPidFile=$BASE/slurmctld.pid
SlurmdPidFile=$BASE/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobCompType=jobcomp/filetxt
JobCompLoc=$BASE/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=${DEFMEM}
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
DependencyParameters=kill_invalid_depend
ReturnToService=2
MinJobAge=600
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MpiDefault=none
MailProg=/bin/true
${EXTRA}NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=${MEM} ${GRES} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF

# --- 3b. optional accounting: MariaDB (socket only) + slurmdbd ---------------
if [ "$ACCT" = 1 ]; then
  install -d -o mysql -g mysql -m 0755 /run/mysqld    # mariadbd runs as mysql: its pid/log go here
  if ! alive /run/mysqld/mariadb.pid; then
    /usr/sbin/mariadbd --user=mysql --datadir=/var/lib/mysql --socket=/run/mysqld/mysqld.sock \
      --pid-file=/run/mysqld/mariadb.pid --log-error=/run/mysqld/mariadb.log --skip-networking \
      </dev/null >/dev/null 2>&1 &
  fi
  for i in $(seq 1 "$(tries)"); do mariadb -e 'select 1' >/dev/null 2>&1 && break; sleep 0.1; done
  mariadb -e 'DROP DATABASE IF EXISTS slurm_acct_db'   # job ids restart at 1: old rows would clash
  cat > /etc/slurm/slurmdbd.conf <<DBD
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=root
LogFile=$BASE/log/slurmdbd.log
PidFile=$BASE/slurmdbd.pid
DBD
  chmod 600 /etc/slurm/slurmdbd.conf                   # slurmdbd refuses a readable config
  /usr/sbin/slurmdbd
  for i in $(seq 1 "$(tries)"); do (exec 3<>/dev/tcp/127.0.0.1/6819) 2>/dev/null && break; sleep 0.1; done
fi

# --- 4. daemons (both fork into the background and write pid files) --------
/usr/sbin/slurmctld
/usr/sbin/slurmd

# --- 5. wait until the node is idle ------------------------------------------
st=""
for i in $(seq 1 $(( WAIT * 5 ))); do
  st=$(timeout 10 sinfo -h -N -n "$NODE" -o %t 2>/dev/null || true)
  [ "$st" = idle ] && break
  sleep 0.2
done
if [ "$st" != idle ]; then
  echo "slurm not ready (node state: '$st')" >&2
  timeout 10 scontrol show node "$NODE" >&2 || true
  tail -n 30 "$BASE"/log/*.log >&2 || true
  exit 1
fi
if [ "$ACCT" = 1 ]; then                    # slurmctld registers the cluster itself
  for i in $(seq 1 "$(tries)"); do
    timeout 10 sacctmgr -n -P show cluster format=cluster 2>/dev/null | grep -qx ci && break; sleep 0.1
  done
fi
printf 'slurm ready in %ss (cpus=%s gpus=%s accounting=%s; munged=%s slurmctld=%s slurmd=%s%s)\n' \
  "$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')" "$CPUS" "$GPUS" "$ACCT" \
  "$(cat /run/munge/munged.pid)" "$(cat "$BASE/slurmctld.pid")" "$(cat "$BASE/slurmd.pid")" \
  "$([ "$ACCT" = 1 ] && echo " slurmdbd=$(cat "$BASE/slurmdbd.pid") mariadbd=$(cat /run/mysqld/mariadb.pid)")"
