#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for the `slurm` tests and CI (.ci/run), from
# Debian's slurmctld, slurmd and munge packages; run as root, without systemd.
#
#   scripts/slurm_local.sh start    # install if missing, start munged + slurmctld + slurmd
#   scripts/slurm_local.sh stop     # stop the daemons this script started
#   scripts/slurm_local.sh env      # the line to eval: export SLURM_CONF=...
#
# Everything lives under $SWEEPS_SLURM_DIR (default /tmp/sweeps-slurm): the config, the state,
# the logs and the pid files; /etc/slurm is left alone, so clients find the cluster through
# SLURM_CONF. No accounting, no cgroups (ProctrackType=proctrack/pgid, TaskPlugin=task/none),
# and short timers so that a requeued job starts again in seconds: cred_expire (how long a
# requeued batch job waits) at its minimum and a one-second scheduler interval.
set -euo pipefail

DIR=${SWEEPS_SLURM_DIR:-/tmp/sweeps-slurm}
CONF=$DIR/slurm.conf
CTLD_PORT=${SWEEPS_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${SWEEPS_SLURM_SLURMD_PORT:-6818}
NODE=$(hostname -s)

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v sbatch >/dev/null && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "slurm_local.sh: slurmctld, slurmd, munge or sbatch is missing; as root: apt-get install slurmctld slurmd munge slurm-client" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd munge slurm-client >/dev/null
}

write_config() {
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
  local cpus mem
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
  cat >"$CONF" <<CONF
ClusterName=sweeps-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
MinJobAge=600
KillWait=30
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  install_packages
  write_config
  export SLURM_CONF=$CONF
  if ! pgrep -x munged >/dev/null; then
    mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
    if id munge >/dev/null 2>&1; then
      runuser -u munge -- /usr/sbin/munged
    else
      /usr/sbin/munged --force
    fi
  fi
  running "$DIR/slurmctld.pid" || /usr/sbin/slurmctld -f "$CONF"
  running "$DIR/slurmd.pid" || /usr/sbin/slurmd -f "$CONF"
  for _ in $(seq 1 60); do
    if scontrol ping >/dev/null 2>&1 && sinfo -h -o %T 2>/dev/null | grep -qx idle; then
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    sleep 1
  done
  echo "slurm_local.sh: the cluster did not come up; see $DIR/log/" >&2
  scontrol ping >&2 || true
  sinfo >&2 || true
  exit 1
}

stop() {
  for pidfile in "$DIR/slurmd.pid" "$DIR/slurmctld.pid"; do
    if running "$pidfile"; then kill "$(cat "$pidfile")"; fi
  done
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
