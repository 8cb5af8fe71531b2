#!/usr/bin/env bash
# Simulated hosts on one machine: network namespaces joined by veth links to a bridge, so that MPI
# ranks started in them talk over TCP only (no shared memory between "hosts"), each link
# optionally shaped by tc's token bucket (tbf) to a line rate.
#
# Usage:
#   tools/netns_hosts.sh check                 exit 0 when namespaces can be made here (root, ip),
#                                              else say why and exit 77
#   tools/netns_hosts.sh run [--hosts N] [--rate RATE] [--] COMMAND [ARGS...]
#       makes N hosts (default 2) h0..h(N-1) with addresses 10.77.X.1..N, shapes every link to
#       RATE in both directions (tc rate, e.g. 10gbit; default: unshaped), runs COMMAND with
#         ATTNRES_HOSTS      the hosts' addresses, comma-separated (for mpirun --host)
#         ATTNRES_MPI_NET    mpirun options: start ranks through tools/netns_agent.sh, TCP only,
#                            on the simulated network
#       and removes every namespace, link and process it made on every exit path (also Ctrl-C).
#   e.g. tools/netns_hosts.sh run --hosts 2 --rate 10gbit -- sh -c \
#          'mpirun $ATTNRES_MPI_NET --host $ATTNRES_HOSTS -np 2 build/attnres train ...'
#   COMMAND runs on host h0, the head node (mpirun starts its ranks there directly). Inside it:
#   tools/netns_hosts.sh cut K    cuts host K off the network (its link down: a partition)
#   tools/netns_hosts.sh kill K   kills every process on host K (a host that dies)
# Every host's TCP gives up on an unanswered peer after about 13 s (net.ipv4.tcp_retries2 = 5,
# Linux's default 15 waits about 15 minutes), and mpirun's daemons probe idle links every few
# seconds (ATTNRES_MPI_NET's oob_tcp_keepalive settings): a cluster set up to notice a lost host.
# The hosts share this machine's cores, so a rank waiting for the network yields its core
# (mpi_yield_when_idle; each host has one slot, so OpenMPI does not know it is oversubscribed:
# 4 hosts on 2 cores trained at 2.9k tokens/s polling, 7.3k yielding).
# No delay is added: this kernel has no netem (tc's delay); the links' own latency is a few us.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SELF="$ROOT/tools/netns_hosts.sh"

die() { echo "netns_hosts: $*" >&2; exit 2; }

can_run() {
  [[ $(id -u) -eq 0 ]] || { echo "netns_hosts: needs root (network namespaces)" >&2; return 77; }
  command -v ip >/dev/null || { echo "netns_hosts: needs ip (iproute2)" >&2; return 77; }
  command -v unshare >/dev/null || { echo "netns_hosts: needs unshare (util-linux)" >&2; return 77; }
  # In a private mount namespace (ip netns mounts /run/netns; nothing may outlive the check), and
  # with `ip netns exec`, which needs / to be a mount point: a chroot has namespaces but cannot
  # enter them.
  local probe="arprobe$$"
  if ! unshare -m --propagation private sh -c \
    "ip netns add $probe && ip netns exec $probe true; r=\$?; ip netns del $probe; exit \$r" \
    >/dev/null 2>&1; then
    echo "netns_hosts: this kernel, container or chroot cannot make and enter network namespaces" >&2
    return 77
  fi
}

# A /24 of 10.77.0.0/16 that no interface here uses (concurrent test beds take different ones).
free_subnet() {
  local x
  for ((i = 0; i < 250; i++)); do
    x=$(( ($$ + i) % 250 ))
    ip -4 addr show | grep -q "inet 10\.77\.$x\." || { echo "$x"; return; }
  done
  die "no free subnet in 10.77.0.0/16"
}

cmd=${1:-}
shift || true
host_arg() {
  [[ -n "${ATTNRES_NETNS_PREFIX:-}" ]] || die "$cmd works inside a test bed's COMMAND only"
  [[ "${1:-}" =~ ^[0-9]+$ ]] || die "$cmd needs a host number (0 = h0)"
}
case "$cmd" in
  check) can_run; exit $? ;;
  cut)
    host_arg "${1:-}"
    exec ip -n "${ATTNRES_NETNS_PREFIX}root" link set "${ATTNRES_NETNS_PREFIX}v$1" down ;;
  kill)
    host_arg "${1:-}"
    ip netns pids "${ATTNRES_NETNS_PREFIX}h$1" | xargs -r kill -9
    exit 0 ;;
  run)
    # Everything below runs in a private mount namespace: the /run/netns mounts that `ip netns`
    # makes go with it, whatever way this script ends.
    if [[ -z "${ATTNRES_NETNS_PRIVATE:-}" ]]; then
      can_run || exit $?
      ATTNRES_NETNS_PRIVATE=1 exec unshare -m --propagation private bash "$SELF" run "$@"
    fi
    ;;
  *) sed -n "2,27p" "$SELF" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac

HOSTS=2 RATE=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --hosts) HOSTS=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --) shift; break ;;
    -*) die "unknown option '$1' (use --hosts N, --rate RATE, then -- COMMAND)" ;;
    *) break ;;
  esac
done
[[ $# -gt 0 ]] || die "no command to run (tools/netns_hosts.sh run [--hosts N] [--rate R] -- CMD)"
[[ "$HOSTS" =~ ^[0-9]+$ && "$HOSTS" -ge 1 && "$HOSTS" -le 64 ]] || die "--hosts must be in [1, 64]"
can_run || exit $?

P="ar$$"  # prefix of every name made here (interface names are at most 15 characters)
NET=$(free_subnet)
# Each host's own temporary directory (TMPDIR): the hosts share this machine's files and its
# hostname, and OpenMPI's daemons raced to make the same session directory in /tmp.
HOST_TMP=$(mktemp -d "${TMPDIR:-/tmp}/attnres-netns.XXXXXX")
teardown() {
  set +e
  for ((h = 0; h < HOSTS; h++)); do
    local ns="${P}h$h"
    if ip netns list 2>/dev/null | grep -qw "$ns"; then
      ip netns pids "$ns" | xargs -r kill -9 2>/dev/null
      ip netns del "$ns"
    fi
    # (a namespace is destroyed only when its last process is gone: its link went with it later,
    # or not at all; deleting our end removes the pair now)
    ip link del "${P}v$h" 2>/dev/null
  done
  ip link del "${P}br" 2>/dev/null
  ip netns del "${P}root" 2>/dev/null  # (the name only: this namespace lives on)
  rm -rf "$HOST_TMP"
}
trap teardown EXIT
trap 'exit 130' INT TERM HUP

shape() {  # device [netns]: tbf at RATE on the device's egress
  [[ -n "$RATE" ]] || return 0
  local run=()
  [[ $# -gt 1 ]] && run=(ip netns exec "$2")
  "${run[@]}" tc qdisc add dev "$1" root tbf rate "$RATE" burst 1mb latency 50ms
}

ip netns attach "${P}root" $$  # a name for this (the root) namespace, for `cut` from a host
ip link add "${P}br" type bridge
ip addr add "10.77.$NET.254/24" dev "${P}br"
ip link set "${P}br" up
addrs=()
for ((h = 0; h < HOSTS; h++)); do
  ns="${P}h$h"
  ip netns add "$ns"
  ip link add "${P}v$h" type veth peer name eth0 netns "$ns"
  ip link set "${P}v$h" master "${P}br" up
  ip -n "$ns" addr add "10.77.$NET.$((h + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  ip netns exec "$ns" sysctl -qw net.ipv4.tcp_retries2=5
  shape "${P}v$h"        # into the host
  shape eth0 "$ns"       # out of it
  addrs+=("10.77.$NET.$((h + 1))")
  mkdir -p "$HOST_TMP/h$h"
done

export ATTNRES_NETNS_PREFIX="$P" ATTNRES_NETNS_TMP="$HOST_TMP"
export ATTNRES_HOSTS
ATTNRES_HOSTS=$(IFS=,; echo "${addrs[*]}")
export ATTNRES_MPI_NET="--mca plm_rsh_agent $ROOT/tools/netns_agent.sh --mca btl tcp,self \
--mca btl_tcp_if_include 10.77.$NET.0/24 --mca oob_tcp_if_include 10.77.$NET.0/24 \
--mca oob_tcp_keepalive_time 5 --mca oob_tcp_keepalive_intvl 2 --mca oob_tcp_keepalive_probes 3 \
--mca mpi_yield_when_idle 1"
set +e
ip netns exec "${P}h0" "$@"
rc=$?
exit $rc
