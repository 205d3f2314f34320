#!/usr/bin/env bash
# A real single-node Slurm cluster for tests/test_slurm.py (Debian's slurm-wlm and munge).
#
#   .ci/slurm_setup.sh install        install the packages if missing (root, apt; ~2 min measured here)
#   .ci/slurm_setup.sh start DIR      start munged, slurmctld and slurmd with everything in DIR
#                                     (config, state, logs, PID files, munge socket) on free ports;
#                                     waits until the node is idle; prints SLURM_CONF=DIR/slurm.conf
#   .ci/slurm_setup.sh stop DIR       stop the three daemons started in DIR, by their PIDs
#
# Nothing outside DIR is written (apart from the packages), so it does not touch a system Slurm.
set -euo pipefail

cmd="${1:-}"
dir="${2:-}"

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null \
    && command -v munged >/dev/null; then
    return 0
  fi
  if [ "$(id -u)" != 0 ]; then
    echo "slurm_setup: slurm-wlm and munge are missing and this is not root; install them:" \
      "apt-get install -y slurm-wlm munge" >&2
    exit 3
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q slurm-wlm munge >/dev/null
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
  [ -n "$dir" ] || { echo "usage: $0 start DIR" >&2; exit 2; }
  [ "$(id -u)" = 0 ] || { echo "slurm_setup: start needs root (slurmd runs jobs as their user)" >&2; exit 3; }
  install
  mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
  chmod 700 "$dir/munge"
  local key=/etc/munge/munge.key
  if [ ! -s "$key" ]; then
    key="$dir/munge/munge.key"
    dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
    chmod 400 "$key"
  fi
  munged --force --key-file="$key" --socket="$dir/munge/munge.sock" --pid-file="$dir/munge/munged.pid" \
    --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"
  local host cpus ctl_port d_port
  host="$(hostname -s)"
  cpus="$(nproc)"
  ctl_port="$(free_port)"
  d_port="$(free_port)"
  while [ "$d_port" = "$ctl_port" ]; do d_port="$(free_port)"; done
  # Job ids (and so keras-sync's auto worker ports) differ between two controllers on one machine.
  local first_job_id=$(( (RANDOM % 5000) * 100 + 1 ))
  cat >"$dir/slurm.conf" <<EOF
ClusterName=kerassync
FirstJobId=${first_job_id}
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${ctl_port}
SlurmdPort=${d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${dir}/munge/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool
SlurmctldPidFile=${dir}/slurmctld.pid
SlurmdPidFile=${dir}/slurmd.pid
SlurmctldLogFile=${dir}/slurmctld.log
SlurmdLogFile=${dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=5
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -c -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
  for _ in $(seq 1 120); do
    if sinfo -h -o '%t' 2>/dev/null | grep -qx 'idle'; then
      echo "SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.5
  done
  echo "slurm_setup: the node did not become idle within 60 s; logs in $dir" >&2
  sinfo >&2 || true
  tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
  exit 1
}

stop() {
  [ -n "$dir" ] || { echo "usage: $0 stop DIR" >&2; exit 2; }
  local pidfile pid
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    [ -s "$pidfile" ] || continue
    pid="$(cat "$pidfile")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
}

case "$cmd" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 install | start DIR | stop DIR" >&2; exit 2 ;;
esac
