#!/bin/bash
# Undo cluster-up.sh, whatever state it reached: jobs, daemons (by pid file), namespaces (which
# removes their links and addresses), the /etc/hosts lines, the SLURM config it replaced.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
state=/run/dgpo-cluster
if [ -S /run/munge/munge.socket.2 ] && [ -e /run/netns/dgpo-ctl ]; then
    "$here/in-cluster" scancel --user=root 2>/dev/null
    for _ in $(seq 30); do [ -z "$("$here/in-cluster" squeue -h 2>/dev/null)" ] && break; sleep 1; done
fi
for f in "$state"/slurmd-node1.pid "$state"/slurmd-node2.pid "$state"/slurmctld.pid; do
    [ -s "$f" ] && kill "$(cat "$f")" 2>/dev/null
done
if [ -e "$state/munged" ] && [ -s /run/munge/munged.pid ]; then kill "$(cat /run/munge/munged.pid)" 2>/dev/null; fi
sleep 2
for n in dgpo-node1 dgpo-node2 dgpo-ctl; do ip netns del "$n" 2>/dev/null; done
sed -i '/^10\.77\.0\.1 slurmctl$/d; /^10\.77\.0\.11 node1$/d; /^10\.77\.0\.12 node2$/d' /etc/hosts
for f in slurm.conf gres.conf; do
    if [ -e "$state/$f.orig" ]; then cp "$state/$f.orig" "/etc/slurm/$f"; else rm -f "/etc/slurm/$f"; fi
done
rm -rf "$state" /var/spool/dgpo-slurm
exit 0
