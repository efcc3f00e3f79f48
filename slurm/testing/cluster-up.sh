#!/bin/bash
# A 2-node SLURM cluster on this one machine, for `make test-cluster`: three network namespaces
# made here and removed by cluster-down.sh (dgpo-ctl: a bridge and slurmctld at 10.77.0.1;
# dgpo-node1/2: one slurmd each at 10.77.0.11/12 with its own hostname). No address exists outside
# these namespaces: SLURM commands run inside dgpo-ctl (slurm/testing/in-cluster). munged runs in
# the root namespace (its Unix socket is reachable from every namespace). Run as root, after
# `apt-get install -y slurm-wlm munge`. Based on ../shared/notes/slurm-on-one-machine.md.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
state=/run/dgpo-cluster
[ ! -e "$state" ] || { echo "cluster-up: $state exists: run cluster-down.sh first" >&2; exit 2; }
mkdir -p "$state"

# 1. network: the bridge lives in its own namespace, not in the machine's
ip netns add dgpo-ctl
ip -n dgpo-ctl link set lo up
ip -n dgpo-ctl link add br0 type bridge
ip -n dgpo-ctl addr add 10.77.0.1/24 dev br0
ip -n dgpo-ctl link set br0 up
for i in 1 2; do
    ip netns add "dgpo-node$i"
    ip -n "dgpo-node$i" link set lo up
    ip link add "veth-n$i" netns dgpo-ctl type veth peer name eth0 netns "dgpo-node$i"
    ip -n dgpo-ctl link set "veth-n$i" master br0
    ip -n dgpo-ctl link set "veth-n$i" up
    ip -n "dgpo-node$i" addr add "10.77.0.1$i/24" dev eth0
    ip -n "dgpo-node$i" link set eth0 up
done
if ! grep -q '^10.77.0.11 node1$' /etc/hosts; then
    printf '10.77.0.1 slurmctl\n10.77.0.11 node1\n10.77.0.12 node2\n' >> /etc/hosts
fi

# 2. munge
mkdir -p /run/munge && chown munge:munge /run/munge
[ -s /etc/munge/munge.key ] || { mungekey -c -f; chown munge:munge /etc/munge/munge.key; }
if ! [ -S /run/munge/munge.socket.2 ] || ! munge -n >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    echo started > "$state/munged"
fi

# 3. config (kept aside and restored by cluster-down.sh)
for f in slurm.conf gres.conf; do [ -e "/etc/slurm/$f" ] && cp "/etc/slurm/$f" "$state/$f.orig"; done
mkdir -p /etc/slurm /var/spool/dgpo-slurm/ctld /var/spool/dgpo-slurm/node1 /var/spool/dgpo-slurm/node2 \
         /var/log/dgpo-slurm
cat > /etc/slurm/slurm.conf <<'CONF'
ClusterName=dgpotest
SlurmctldHost=slurmctl(10.77.0.1)
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/dgpo-slurm/ctld
SlurmdSpoolDir=/var/spool/dgpo-slurm/%n
SlurmctldPidFile=/run/dgpo-cluster/slurmctld.pid
SlurmdPidFile=/run/dgpo-cluster/slurmd-%n.pid
SlurmctldLogFile=/var/log/dgpo-slurm/slurmctld.log
SlurmdLogFile=/var/log/dgpo-slurm/slurmd-%n.log
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
KillWait=30
MinJobAge=600
NodeName=node1 NodeAddr=10.77.0.11 NodeHostname=node1 CPUs=1 RealMemory=8000 Gres=gpu:8 State=UNKNOWN
NodeName=node2 NodeAddr=10.77.0.12 NodeHostname=node2 CPUs=1 RealMemory=8000 Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
CONF
# 8 fake GPUs per node (char devices like /dev/null) so that the scripts' unmodified
# '#SBATCH --gpus-per-node=8' and NeMo-Run's --gpus-per-node are satisfiable
for g in 0 1 2 3 4 5 6 7; do mknod "$state/gpu$g" c 1 3; done
echo "NodeName=node[1-2] Name=gpu File=$state/gpu[0-7]" > /etc/slurm/gres.conf

# 4. daemons: nsenter --net, not `ip netns exec` (which remounts /sys and hides the cgroup fs
# slurmd 22.05 needs); unshare --uts gives each its own hostname
nsenter --net=/run/netns/dgpo-ctl unshare --uts sh -c 'hostname slurmctl && exec /usr/sbin/slurmctld'
for n in node1 node2; do
    nsenter --net=/run/netns/dgpo-$n unshare --uts sh -c "hostname $n && exec /usr/sbin/slurmd -N $n"
done
for _ in $(seq 60); do
    [ "$("$here/in-cluster" sinfo -h -o %T 2>/dev/null | sort -u)" = idle ] && break
    sleep 1
done
"$here/in-cluster" sinfo
[ "$("$here/in-cluster" sinfo -h -o %T | sort -u)" = idle ] || { echo "cluster-up: nodes not idle" >&2; exit 1; }
