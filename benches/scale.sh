#!/bin/sh
# Refresh at scale (DESIGN §10): a remote tree of 10 000 layers and 1 000 images (1 000 chains
# of 10 layers, an image on each), mounted with refresh=0 so that only the rounds this script
# asks for run. Measures mount time, an idle round, a round after adding 10 chains and their
# images and removing 10 others (110 objects each way), and the daemon's RSS.
#
# Rounds are triggered with SIGUSR1, which runs one and logs its duration.
#
# Usage: benches/scale.sh [CHAINS [DEPTH]]   (as root; needs /dev/fuse and python3)
# With RUST_LOG=info,layerfs::refresh=debug,layerfs::layout=debug the change round's phases
# (scan per area, readiness, diff, swap, invalidation) are printed too.
set -eu

CHAINS=${1:-1000}
DEPTH=${2:-10}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
BIN=${LAYERFS:-$REPO/target/release/layerfs}
[ -x "$BIN" ] || (cd "$REPO" && cargo build --release --quiet)

WORK=$(mktemp -d /tmp/layerfs-scale.XXXXXX)
PID=
cleanup() {
    if mountpoint -q "$WORK/mnt" 2>/dev/null; then umount "$WORK/mnt" || umount -l "$WORK/mnt"; fi
    [ -n "$PID" ] && wait "$PID" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM
mkdir -p "$WORK/remote" "$WORK/local" "$WORK/mnt"

now_ms() { date +%s%3N; }

echo "generating $CHAINS chains of $DEPTH layers + $CHAINS images ..."
python3 "$HERE/scale_gen.py" create "$WORK/remote" --chains "$CHAINS" --depth "$DEPTH"
# Stamps younger than the racy margin (2 s) are re-read on purpose; let them settle so the
# idle round measures the steady state.
sleep 3

LOG=$WORK/layerfs.log
start=$(now_ms)
RUST_LOG=${RUST_LOG:-info} "$BIN" mount --remote "$WORK/remote" --local "$WORK/local" \
    -o refresh=0,allow_other -f "$WORK/mnt" 2>"$LOG" &
PID=$!
while ! mountpoint -q "$WORK/mnt"; do
    kill -0 "$PID" 2>/dev/null || { cat "$LOG"; exit 1; }
    sleep 0.005
done
mount_ms=$(( $(now_ms) - start ))
ls "$WORK/mnt/overlay-images" >/dev/null

# Runs one round via SIGUSR1 and prints its duration in ms (from the daemon's log).
round() {
    before=$(grep -c "refresh round on SIGUSR1" "$LOG" || true)
    kill -USR1 "$PID"
    while [ "$(grep -c "refresh round on SIGUSR1" "$LOG" || true)" -le "$before" ]; do sleep 0.01; done
    grep "refresh round on SIGUSR1" "$LOG" | tail -n 1 | sed -n 's/.* ms=\([0-9.]*\).*/\1/p' |
        awk '{ printf "%.1f", $1 }'
}
summary() { grep "refresh round on SIGUSR1" "$LOG" | tail -n 1 | sed 's/.*SIGUSR1 //'; }

round >/dev/null                       # warm: first rounds may re-check fresh stamps
idle1=$(round)
idle2=$(round)
idle3=$(round)

python3 "$HERE/scale_gen.py" add "$WORK/remote" --first "$CHAINS" --count 10 --depth "$DEPTH"
python3 "$HERE/scale_gen.py" remove "$WORK/remote" --first 0 --count 10 --depth "$DEPTH"
changes=$(round)
changes_line=$(summary)
after=$(round)

rss_kib=$(sed -n 's/^VmRSS:[[:space:]]*\([0-9]*\) kB/\1/p' "/proc/$PID/status")
layers=$(ls "$WORK/mnt/overlay/RO" | wc -l)
images=$(ls "$WORK/mnt/overlay-images" | wc -l)

printf '\nlayerfs refresh at scale: %s layers, %s images in the view\n' "$layers" "$images"
printf '%-44s %12s %14s\n' "measure" "value" "target (§10)"
printf '%-44s %10s ms %14s\n' "mount (first full scan included)" "$mount_ms" "-"
printf '%-44s %10s ms %14s\n' "idle round (3 runs)" "$idle1 / $idle2 / $idle3" "< 20 ms"
printf '%-44s %10s ms %14s\n' "round: +110 / -110 objects" "$changes" "< 100 ms"
printf '%-44s %10s ms %14s\n' "next round (fresh stamps re-checked)" "$after" "-"
printf '%-44s %10s MiB %13s\n' "daemon RSS" "$((rss_kib / 1024))" "< 100 MiB"
printf '\nchange round: %s\n' "$changes_line"
# The last round that judged anything is the change round (the next one finds nothing new).
phases=$(grep -E "area scanned|remote scanned and judged|refresh round phases" "$LOG" |
    grep -B 4 "refresh round phases" | tail -n 5 | sed 's/.*layerfs::[a-z:]*: //')
[ -z "$phases" ] || printf '%s\n' "$phases"
