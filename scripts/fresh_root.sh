#!/usr/bin/env bash
# Runs a command in a brand-new minimal Debian 12 root (mmdebstrap + chroot) on a copy of the
# project: what a new user's machine sees, with nothing installed by hand. CI's first stage.
#
#   bash scripts/fresh_root.sh                          # bash scripts/test.sh in a fresh root
#   bash scripts/fresh_root.sh 'bash scripts/demo.sh'   # any command, run from the project root
#   bash scripts/fresh_root.sh --worktree ...           # tracked files as on disk (uncommitted
#                                                       # edits included), not the commit HEAD
#   bash scripts/fresh_root.sh --keep ...               # keep the root afterwards (path printed)
#
# The command runs as root with a clean environment (HOME=/root, PATH, LANG=C.UTF-8, CI=true).
# Needs root, ~4 GiB of disk and the Debian archive; installs mmdebstrap on the host if missing.
# Settings (environment): FRESH_ROOT (folder to make; default a new one under /var/tmp),
# FRESH_MIRROR (default http://deb.debian.org/debian), FRESH_TIMEOUT (seconds for the command,
# default 3600). Mounts are undone on every exit path; an unreachable archive fails in seconds.
set -euo pipefail
usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }
keep=0
tree=head
while (($#)); do
  case "$1" in
    --keep) keep=1 ;;
    --worktree) tree=worktree ;;
    -h | --help) usage; exit 0 ;;
    --*) echo "fresh_root: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
cmd=${1:-bash scripts/test.sh}
mirror=${FRESH_MIRROR:-http://deb.debian.org/debian}
limit=${FRESH_TIMEOUT:-3600}
die() { echo "fresh_root: $*" >&2; exit 2; }

[[ $(id -u) -eq 0 ]] || die "run as root (it makes a chroot and mounts /dev, /proc and /sys in it)"
top=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel 2>/dev/null) ||
  die "run it inside the project's git checkout"
[[ "$limit" =~ ^[1-9][0-9]*$ ]] || die "FRESH_TIMEOUT='$limit' is not a positive number of seconds"

# The archive first: a clear message in seconds, never a hang in apt. Over http, ask for the
# suite's Release file (a proxy may accept any connection); over https, a TCP connection.
# The URL is checked and split here; its parts reach the probe as arguments, never as code.
[[ "$mirror" =~ ^(https?)://([A-Za-z0-9.-]+)(:([0-9]{1,5}))?(/[A-Za-z0-9._~/%+-]*)?$ ]] ||
  die "FRESH_MIRROR='$mirror' is not an http:// or https:// URL of a Debian archive (e.g.
  http://deb.debian.org/debian)"
scheme=${BASH_REMATCH[1]}
host=${BASH_REMATCH[2]}
port=${BASH_REMATCH[4]:-}
path=${BASH_REMATCH[5]:-}
[[ -n "$port" ]] || { [[ $scheme == https ]] && port=443 || port=80; }
((port >= 1 && port <= 65535)) || die "FRESH_MIRROR='$mirror' has port $port, outside 1-65535"
probe_http() {  # host port path -> the status line of HEAD path/dists/bookworm/Release
  exec 3<>"/dev/tcp/$1/$2" || return 1
  printf 'HEAD %s/dists/bookworm/Release HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n' \
    "$3" "$1" >&3
  head -1 <&3
}
probe_tcp() { exec 3<>"/dev/tcp/$1/$2"; }
export -f probe_http probe_tcp
if [[ $scheme == http ]]; then
  status=$(timeout 20 bash -c 'probe_http "$@"' _ "$host" "$port" "$path" 2>/dev/null || true)
  [[ "$status" == HTTP/*" 200"* ]] ||
    die "the Debian archive $mirror cannot be reached (asked for dists/bookworm/Release within 20 s,
  got: ${status:-no answer}); check the network, or set FRESH_MIRROR to a reachable mirror"
elif ! timeout 20 bash -c 'probe_tcp "$@"' _ "$host" "$port" 2>/dev/null; then
  die "the Debian archive $mirror cannot be reached (no TCP connection to $host:$port within 20 s);
  check the network, or set FRESH_MIRROR to a reachable mirror"
fi
APT_OPTS=('Acquire::http::Timeout "30";' 'Acquire::https::Timeout "30";' 'Acquire::Retries "2";')
if ! command -v mmdebstrap >/dev/null; then
  echo "[fresh] installing mmdebstrap on the host"
  timeout 600 apt-get -o Acquire::http::Timeout=30 update -qq &&
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get -o Acquire::http::Timeout=30 install -y -qq \
      --no-install-recommends mmdebstrap >/dev/null ||
    die "could not install mmdebstrap (apt-get install mmdebstrap) from the archive"
fi

if [[ -n "${FRESH_ROOT:-}" ]]; then
  [[ "$FRESH_ROOT" == /* ]] || die "FRESH_ROOT='$FRESH_ROOT' must be an absolute path"
  root=$(realpath -m "$FRESH_ROOT")
  [[ "$root" == /*/* ]] || die "FRESH_ROOT='$FRESH_ROOT' must be a folder at least two levels deep"
  [[ ! -e "$root" ]] || [[ -z $(ls -A "$root") ]] || [[ -e "$root/.attnres-fresh-root" ]] ||
    die "FRESH_ROOT='$root' exists and is not a root this script made; give a new folder"
else
  root=$(mktemp -d /var/tmp/attnres-fresh.XXXXXX)
fi

mounts=(dev/pts dev proc sys)  # innermost first, for unmounting
unmount_all() {
  local m
  for m in "${mounts[@]}"; do
    if mountpoint -q "$root/$m" 2>/dev/null; then umount "$root/$m" 2>/dev/null || umount -l "$root/$m"; fi
  done
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  unmount_all
  if ((keep)); then
    echo "[fresh] root kept in $root"
  elif grep -q " $root/" /proc/mounts; then  # never delete through a mounted /dev, /proc or /sys
    echo "fresh_root: something is still mounted under $root; not deleting it" >&2
  else
    rm -rf --one-file-system "$root"
  fi
  exit "$rc"
}
# Long steps run in the background and are waited for, so a signal to this script is acted on
# at once: the step is stopped (timeout passes the signal to its whole process group), then the
# EXIT trap unmounts and deletes.
child=""
run_step() {
  "$@" &
  child=$!
  local rc=0
  wait "$child" || rc=$?
  child=""
  return "$rc"
}
on_signal() {
  if [[ -n "$child" ]]; then
    kill -TERM "$child" 2>/dev/null || true
    wait "$child" 2>/dev/null || true
  fi
  exit "$1"
}
trap cleanup EXIT
trap 'on_signal 130' INT
trap 'on_signal 143' TERM
trap 'on_signal 129' HUP
unmount_all
grep -q " $root/" /proc/mounts && die "something is still mounted under $root; unmount it first"
rm -rf --one-file-system "$root"
mkdir -p "$root"

echo "[fresh] making a minimal Debian 12 root in $root (from $mirror)"
t0=$SECONDS
aptopts=()
for o in "${APT_OPTS[@]}"; do aptopts+=(--aptopt="$o"); done
run_step timeout 1200 mmdebstrap --quiet --variant=apt --mode=root "${aptopts[@]}" bookworm "$root" "$mirror" ||
  die "mmdebstrap could not make the root (archive $mirror unreachable or too slow?); see above"
touch "$root/.attnres-fresh-root"
# apt inside the root gives up instead of hanging when the archive goes away.
printf '%s\n' "${APT_OPTS[@]}" >"$root/etc/apt/apt.conf.d/80fresh-root-timeouts"
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
echo "[fresh] root ready in $((SECONDS - t0)) s"

mkdir -p "$root/src/attnres"
if [[ $tree == head ]]; then
  git -C "$top" archive --format=tar HEAD | tar -xf - -C "$root/src/attnres"
  echo "[fresh] copied the committed tree ($(git -C "$top" rev-parse --short HEAD))"
else
  (cd "$top" && git ls-files -z | tar --null --ignore-failed-read -T - -cf -) | tar -xf - -C "$root/src/attnres"
  echo "[fresh] copied the tracked files as they are on disk"
fi

mount --bind /dev "$root/dev"
mount --bind /dev/pts "$root/dev/pts"
mount -t proc proc "$root/proc"
mount -t sysfs sys "$root/sys"
echo "[fresh] running in the new root: $cmd"
t0=$SECONDS
rc=0
run_step timeout --kill-after=30 "$limit" chroot "$root" /usr/bin/env -i HOME=/root \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 CI=true \
  bash -c "cd /src/attnres && $cmd" || rc=$?
if ((rc == 124 || rc == 137)); then
  echo "fresh_root: '$cmd' ran past FRESH_TIMEOUT=$limit s and was stopped" >&2
fi
echo "[fresh] '$cmd' exited $rc after $((SECONDS - t0)) s"
exit "$rc"
