#!/usr/bin/env bash
# A private single-node Slurm (slurmctld + slurmd + munged) for tests and for trying
# `--command_launcher slurm` on one machine.
#
#   bash scripts/local_slurm.sh start     # prints `export SLURM_CONF=...`; idempotent
#   bash scripts/local_slurm.sh status    # exit 0 when all three daemons run
#   bash scripts/local_slurm.sh stop      # cancels its jobs, stops the daemons; idempotent
#
# Everything lives under one folder, LOCAL_SLURM_DIR (default /tmp/vasso-slurm-$UID):
# its own munge key, socket, pid and log files (munged --key-file/--socket, Slurm's
# AuthInfo=socket=...), Slurm's state, spool, pid and log files, slurm.conf with two
# free TCP ports of its own. It never reads or writes /etc/munge or /etc/slurm and
# never talks to another Slurm: use it with SLURM_CONF=$LOCAL_SLURM_DIR/slurm.conf.
# `stop` stops the processes whose ids it recorded, nothing found by name.
#
# Runs as whoever starts it: the three daemons run as that user (SlurmUser and
# SlurmdUser are that user), which is all a private Slurm needs, except that slurmd
# can then run jobs of that user only (switching to another user needs root). Root is
# needed once, for Debian's packages `slurm-wlm munge`: `start` installs them with
# apt-get when they are missing and it runs as root on a Debian-like system (CI), and
# otherwise says what is missing and the command that installs them.
# Node: this host's short name (uname -n) with CPUs=$(nproc), one partition `debug` (Default,
# OverSubscribe). Accounting is off (no sacct: submitit warns and carries on).
set -euo pipefail

DIR=${LOCAL_SLURM_DIR:-${TMPDIR:-/tmp}/vasso-slurm-$(id -u)}
CONF=$DIR/slurm.conf
MUNGE_SOCKET=$DIR/munge/munge.socket
DAEMONS=(munged slurmctld slurmd)

say() { echo "local_slurm: $*"; }
die() { echo "local_slurm: error: $*" >&2; exit 1; }

pidfile() {
    case $1 in
        munged) echo "$DIR/munge/munged.pid" ;;
        *) echo "$DIR/run/$1.pid" ;;
    esac
}

# The pid recorded for daemon $1, when that process is alive and is ours (its command
# line names our folder or our conf: a recycled pid is not ours).
live_pid() {
    local f pid
    f=$(pidfile "$1")
    [ -s "$f" ] || return 1
    pid=$(tr -dc 0-9 <"$f")
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$DIR" || return 1
    echo "$pid"
}

running_all() {
    local d
    for d in "${DAEMONS[@]}"; do live_pid "$d" >/dev/null || return 1; done
}

install_packages() {
    local missing=()
    command -v munged >/dev/null || missing+=(munge)
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null || missing+=(slurm-wlm)
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        say "installing ${missing[*]} with apt-get"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
    else
        die "missing ${missing[*]}: install Slurm's and munge's daemons once, as root (Debian/Ubuntu: sudo apt-get install slurm-wlm munge); then start this as your user"
    fi
}

free_ports() {  # two distinct free TCP ports
    python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

write_conf() {
    local host cpus ctld_port slurmd_port
    host=$(uname -n | cut -d. -f1)  # slurmd finds its node by this short host name
    cpus=$(nproc)
    read -r ctld_port slurmd_port < <(free_ports)
    cat >"$CONF" <<EOF
# Written by scripts/local_slurm.sh: a private single-node Slurm under $DIR
ClusterName=vasso-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$(id -un)
SlurmdUser=$(id -un)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MinJobAge=300
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES OverSubscribe=YES MaxTime=INFINITE State=UP
EOF
}

stop() {
    local d pid n
    if pid=$(live_pid slurmctld); then
        # cancel our jobs first: slurmd leaves running steps alive when it stops
        if [ -n "$(SLURM_CONF=$CONF squeue -h -o %A 2>/dev/null)" ]; then
            SLURM_CONF=$CONF scancel --full --quiet $(SLURM_CONF=$CONF squeue -h -o %A | sort -u) || true
            for n in $(seq 60); do
                [ -z "$(SLURM_CONF=$CONF squeue -h -o %A 2>/dev/null)" ] && break
                sleep 0.5
            done
        fi
    fi
    for d in slurmd slurmctld munged; do
        pid=$(live_pid "$d") || continue
        kill -TERM "$pid" 2>/dev/null || true
        for n in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        if kill -0 "$pid" 2>/dev/null; then
            kill -KILL "$pid" 2>/dev/null || true
            sleep 0.2
        fi
        say "stopped $d (pid $pid)"
    done
    rm -f "$DIR"/run/*.pid "$DIR"/munge/munged.pid
}

start() {
    if running_all; then
        say "already running under $DIR"
        echo "export SLURM_CONF=$CONF"
        return 0
    fi
    install_packages
    stop >/dev/null  # whatever part of an earlier start is left
    mkdir -p "$DIR"/{munge,state,spool,run,log}
    chmod 700 "$DIR" "$DIR/munge"
    if [ ! -s "$DIR/munge/munge.key" ]; then
        (umask 077; head -c 1024 /dev/urandom >"$DIR/munge/munge.key")
    fi
    write_conf
    # --force: the key may sit below a world-writable /tmp, which munged otherwise refuses
    munged --force --key-file "$DIR/munge/munge.key" --socket "$MUNGE_SOCKET" \
        --pid-file "$DIR/munge/munged.pid" --log-file "$DIR/log/munged.log" \
        --seed-file "$DIR/munge/munged.seed" \
        || die "munged did not start; see $DIR/log/munged.log"
    export SLURM_CONF=$CONF
    slurmctld -f "$CONF" || die "slurmctld did not start; see $DIR/log/slurmctld.log"
    slurmd -f "$CONF" || die "slurmd did not start; see $DIR/log/slurmd.log"
    local n
    for n in $(seq 60); do
        if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
            running_all || die "a daemon exited; see $DIR/log/"
            say "running under $DIR ($(sinfo -h -o '%P %D node(s) %c CPUs %t'))"
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
        sleep 0.5
    done
    stop >/dev/null
    die "the node did not come up within 30 s; see $DIR/log/"
}

status() {
    local d pid ok=0
    for d in "${DAEMONS[@]}"; do
        if pid=$(live_pid "$d"); then say "$d running (pid $pid)"; else say "$d not running"; ok=1; fi
    done
    if [ $ok -eq 0 ]; then
        SLURM_CONF=$CONF sinfo || true
        echo "export SLURM_CONF=$CONF"
    fi
    return $ok
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: [LOCAL_SLURM_DIR=dir] bash scripts/local_slurm.sh start|stop|status" >&2; exit 2 ;;
esac
