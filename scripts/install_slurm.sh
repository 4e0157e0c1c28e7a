#!/usr/bin/env bash
# SLURM (slurmctld, slurmd, the clients) and munge from the distribution's packages, when missing: the SLURM tests
# (tests/test_slurm.py) stand up a 2-node cluster of them on this machine. Needs root and apt-get; exits non-zero
# with the reason otherwise (the tests are then skipped, naming it). The daemons are not started here: the packages'
# own service start is refused in containers (policy-rc.d) and the tests start their own, privately configured.
set -euo pipefail
missing=()
for tool in slurmctld slurmd sbatch munged; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
[ ${#missing[@]} = 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then echo "install_slurm: ${missing[*]} missing and not root (apt-get install slurmctld slurmd slurm-client munge)" >&2; exit 1; fi
if ! command -v apt-get >/dev/null 2>&1; then echo "install_slurm: ${missing[*]} missing and no apt-get here" >&2; exit 1; fi
export DEBIAN_FRONTEND=noninteractive
# invoke-rc.d: keep the packages from starting system-wide daemons where services can be started.
policy=/usr/sbin/policy-rc.d; made_policy=0
if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; made_policy=1; fi
trap 'if [ $made_policy = 1 ]; then rm -f "$policy"; fi' EXIT
apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
