#!/usr/bin/env bash
# Publication through a remote without inotify (DESIGN §14): a writer tree with a publisher
# (`layerfs publish --watch`), reached by two reader mounts through sshfs (each its own sshfs
# connection to an sshd on loopback, as two hosts would have). Measures, per reader:
#   - idle remote requests per second (counted on the sshfs side, `sshfs_debug`);
#   - how long after the writer finished an image every reader shows it (COUNT publications);
# while a third process keeps reading a file of an existing layer through the first reader.
#
# Knobs (environment):
#   CHAINS=50 DEPTH=10   the tree: CHAINS images, each on its own chain of DEPTH layers
#   COUNT=50             publications
#   IDLE=30              seconds of idle counting
#   JOURNAL=1            0: readers mount with nojournal and no publisher runs (the baseline)
#   READER_OPTS=         extra -o options of the readers (e.g. journal_poll=100)
#   SSHFS_OPTS=          extra sshfs -o options (e.g. cache=no)
#   SCRATCH=/var/tmp/layerfs-bench
# Needs root, /dev/fuse, python3, sshfs and openssh-server (apt-get install -y sshfs openssh-server).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CHAINS=${CHAINS:-50}
DEPTH=${DEPTH:-10}
COUNT=${COUNT:-50}
IDLE=${IDLE:-30}
JOURNAL=${JOURNAL:-1}
NO_JOURNAL=
READER_OPTS=${READER_OPTS:-}
SSHFS_OPTS=${SSHFS_OPTS:-}
SCRATCH=${SCRATCH:-/var/tmp/layerfs-bench}
LAYERFS=${LAYERFS:-$REPO/target/release/layerfs}

log() { printf '[publish-bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'publish-bench: %s\n' "$*" >&2; exit 1; }
# shellcheck source=benches/common.sh
. "$REPO/benches/common.sh"

case "${1:-}" in
    -h|--help) print_usage "$0"; exit 0 ;;
    "") ;;
    *) die "unknown argument '$1' (configure with environment variables, see --help)" ;;
esac
[ "$(id -u)" -eq 0 ] || die "run as root"
for tool in sshfs /usr/sbin/sshd ssh-keygen python3; do
    command -v "$tool" >/dev/null || die "missing $tool: apt-get install -y sshfs openssh-server python3"
done
[ -x "$LAYERFS" ] || (cd "$REPO" && cargo build --release --quiet)

mkdir -p "$SCRATCH"
RUN=$(mktemp -d "$SCRATCH/publish.XXXXXX")
PIDS=()
cleanup() {
    local rc=$?
    set +e
    for m in "$RUN"/mnt-*; do
        [ -d "$m" ] && mountpoint -q "$m" && "$LAYERFS" umount "$m" >/dev/null 2>&1
    done
    for m in "$RUN"/carrier-*; do
        [ -d "$m" ] && mountpoint -q "$m" && { umount "$m" 2>/dev/null || umount -l "$m"; }
    done
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    [ -f "$RUN/sshd.pid" ] && kill "$(cat "$RUN/sshd.pid")" 2>/dev/null
    sleep 0.5
    rm -rf --one-file-system "$RUN"
    exit "$rc"
}
trap cleanup EXIT INT TERM

log "tree: $CHAINS images on chains of $DEPTH layers ($((CHAINS * DEPTH)) layers)"
python3 "$REPO/benches/scale_gen.py" create "$RUN/real" --chains "$CHAINS" --depth "$DEPTH"

mkdir -p /run/sshd
ssh-keygen -q -t ed25519 -N '' -f "$RUN/hostkey"
ssh-keygen -q -t ed25519 -N '' -f "$RUN/userkey"
cp "$RUN/userkey.pub" "$RUN/authorized_keys"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat >"$RUN/sshd_config" <<EOF
ListenAddress 127.0.0.1
Port $PORT
HostKey $RUN/hostkey
AuthorizedKeysFile $RUN/authorized_keys
PidFile $RUN/sshd.pid
StrictModes no
UsePAM no
PermitRootLogin yes
PasswordAuthentication no
Subsystem sftp internal-sftp
EOF
/usr/sbin/sshd -f "$RUN/sshd_config"

if [ "$JOURNAL" = 1 ]; then
    "$LAYERFS" publish --watch "$RUN/real" --name writer 2>"$RUN/publisher.log" &
    PIDS+=($!)
    for _ in $(seq 50); do [ -f "$RUN/real/layerfs-journal/bell" ] && break; sleep 0.1; done
    [ -f "$RUN/real/layerfs-journal/bell" ] || die "the publisher did not start: $(cat "$RUN/publisher.log")"
    READER_JOURNAL=journal
else
    READER_JOURNAL=nojournal
    NO_JOURNAL=1
fi

for r in a b; do
    mkdir -p "$RUN/carrier-$r" "$RUN/local-$r" "$RUN/mnt-$r"
    sshfs -f -p "$PORT" \
        -o "IdentityFile=$RUN/userkey,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,sshfs_debug,ro${SSHFS_OPTS:+,$SSHFS_OPTS}" \
        "root@127.0.0.1:$RUN/real" "$RUN/carrier-$r" >"$RUN/sshfs-$r.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do mountpoint -q "$RUN/carrier-$r" && break; sleep 0.1; done
    mountpoint -q "$RUN/carrier-$r" || die "sshfs did not mount: $(cat "$RUN/sshfs-$r.log")"
    "$LAYERFS" mount --remote "$RUN/carrier-$r" --local "$RUN/local-$r" \
        -o "$READER_JOURNAL${READER_OPTS:+,$READER_OPTS}" "$RUN/mnt-$r"
done
log "two readers over sshfs mounted ($READER_JOURNAL); measuring $IDLE s idle, then $COUNT publications"

python3 "$REPO/benches/publish_probe.py" "$RUN/real" \
    "$RUN/mnt-a" "$RUN/sshfs-a.log" "$RUN/mnt-b" "$RUN/sshfs-b.log" \
    --layerfs "$LAYERFS" --first "$CHAINS" --count "$COUNT" --depth "$DEPTH" --idle "$IDLE" \
    ${NO_JOURNAL:+--no-journal} >"$RUN/summary.json" || die "the probe failed"
python3 - "$RUN/summary.json" "$CHAINS" "$DEPTH" "$READER_JOURNAL" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
chains, depth, mode = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
print(f"## publication over sshfs ({mode}; {chains * depth} layers, {chains} images)\n")
print("| reader | idle requests/s | median s | p99 s | max s | missed |")
print("|---|---:|---:|---:|---:|---:|")
for name, r, idle in zip("ab", s["readers"], s["idle_requests_per_s"]):
    print(f"| {name} | {idle} | {r['median_s']} | {r['p99_s']} | {r['max_s']} | {r['missed']} |")
t = s["third_process"]
print(f"\n{s['publications']} publications; third process: {t['reads']} reads, {t['errors']} errors"
      + (f" (first: {t['first_error']})" if t["errors"] else ""))
EOF
