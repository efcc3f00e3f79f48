#!/bin/bash
# Installs what the real-SLURM tests need (Debian's slurm-wlm and munge) when this machine allows
# it (root with apt-get), and says plainly when it cannot: those tests then skip with the reason.
set -u
if command -v slurmctld >/dev/null || [ -x /usr/sbin/slurmctld ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "make test-cluster: slurm-wlm/munge are not installed and cannot be (needs root and apt-get):" \
         "the real-SLURM tests will SKIP" >&2
    exit 0
fi
echo "make test-cluster: installing slurm-wlm and munge (Debian packages)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq && apt-get install -y -qq slurm-wlm munge >/dev/null ||
    echo "make test-cluster: apt-get install slurm-wlm munge failed: the real-SLURM tests will SKIP" >&2
exit 0
