#!/bin/sh
# Memory and descriptors of the daemon over a churn of N files (default 1 000 000): all are
# created (and stay in the kernel's cache), then all are deleted. The daemon holds every
# object the kernel knows open, trims the kernel's cache once its nodes may hold 60 % of its
# open-file limit, and keeps nothing per file once the kernel forgot it (DESIGN §3, §10).
#
# Usage: benches/churn.sh [N]   (as root; needs /dev/fuse and python3)
set -eu

N=${1:-1000000}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
BIN=${LAYERFS:-$REPO/target/release/layerfs}
[ -x "$BIN" ] || (cd "$REPO" && cargo build --release --quiet)

WORK=$(mktemp -d /tmp/layerfs-churn.XXXXXX)
PID=
cleanup() {
    if mountpoint -q "$WORK/mnt" 2>/dev/null; then umount "$WORK/mnt" || umount -l "$WORK/mnt"; fi
    [ -n "$PID" ] && wait "$PID" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM
mkdir -p "$WORK/local" "$WORK/mnt"
cp -a "$REPO/fixtures/remote" "$WORK/remote"

"$BIN" mount --remote "$WORK/remote" --local "$WORK/local" -o allow_other -f "$WORK/mnt" \
    2>"$WORK/layerfs.log" &
PID=$!
while ! mountpoint -q "$WORK/mnt"; do
    kill -0 "$PID" 2>/dev/null || { cat "$WORK/layerfs.log"; exit 1; }
    sleep 0.01
done
echo "layerfs $("$BIN" --version 2>/dev/null | head -n 1); open-file limit: $(awk '/Max open files/ {print $4}' /proc/$PID/limits)"
python3 "$HERE/churn.py" "$WORK/mnt" "$PID" "$N"
