#!/usr/bin/env bash
# mpirun's launch agent on the simulated hosts of tools/netns_hosts.sh (--mca plm_rsh_agent): it is
# called as `netns_agent.sh HOST COMMAND...` like ssh, and runs COMMAND in the namespace of HOST
# (10.77.X.K is host K-1 of the test bed named by ATTNRES_NETNS_PREFIX).
set -euo pipefail
host=$1
shift
[[ -n "${ATTNRES_NETNS_PREFIX:-}" ]] || { echo "netns_agent: run under tools/netns_hosts.sh" >&2; exit 2; }
[[ "$host" =~ ^10\.77\.[0-9]+\.([0-9]+)$ ]] || { echo "netns_agent: '$host' is not a test-bed host" >&2; exit 2; }
h=$((BASH_REMATCH[1] - 1))
# (TMPDIR: the host's own, see netns_hosts.sh)
exec ip netns exec "${ATTNRES_NETNS_PREFIX}h$h" env TMPDIR="${ATTNRES_NETNS_TMP:-/tmp}/h$h" \
  /bin/sh -c "$*"
