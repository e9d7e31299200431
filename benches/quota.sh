#!/usr/bin/env bash
# Writes inside a quota root vs outside one, on one layerfs mount (DESIGN §10: 1 MiB sequential
# writes inside a quota root >= 0.9x outside, reads as fast). See benches/README.md.
# Needs root, /dev/fuse, fio, fuse3, python3.
#
# Knobs (environment):
#   SIZE=256M      file size of the fio jobs
#   RUNTIME=10s    duration of the time-based 4 KiB random-write job
#   REPEAT=1       rounds (each round runs both dirs, alternating which goes first); medians shown
#   QUOTA=1T       the quota of the quota root (large, so it never fills)
#   SCRATCH=/var/tmp/layerfs-bench   scratch area (a per-run subdir is created and removed)
#   LAYERFS=target/release/layerfs   layerfs binary (built with cargo build --release if missing)
#   OPTS=          extra -o mount options, e.g. io_uring (then turn the fuse module's
#                  enable_uring on first)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH_PY="$REPO/benches/bench.py"
FIXTURE="$REPO/fixtures/remote"

SIZE=${SIZE:-256M}
RUNTIME=${RUNTIME:-10s}
REPEAT=${REPEAT:-1}
QUOTA=${QUOTA:-1T}
SCRATCH=${SCRATCH:-/var/tmp/layerfs-bench}
LAYERFS=${LAYERFS:-$REPO/target/release/layerfs}

log() { printf '[quota-bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'quota-bench: %s\n' "$*" >&2; exit 1; }
# shellcheck source=benches/common.sh
. "$REPO/benches/common.sh"

case "${1:-}" in
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) die "unknown argument '$1' (configure with environment variables, see --help)" ;;
esac

[[ "$RUNTIME" =~ ^[0-9]+(ms|s|m)?$ ]] || die "RUNTIME must look like 10s, 30 or 1m, got '$RUNTIME'"
[[ "$REPEAT" =~ ^[0-9]+$ && "$REPEAT" -gt 0 ]] || die "REPEAT must be a positive integer, got '$REPEAT'"

missing=()
[ "$(id -u)" -eq 0 ] || missing+=("root (run with sudo)")
command -v python3 >/dev/null || missing+=("python3")
command -v fio >/dev/null || missing+=("fio")
[ -c /dev/fuse ] || missing+=("/dev/fuse (modprobe fuse)")
command -v fusermount3 >/dev/null || missing+=("fusermount3 (package fuse3)")
if [ "${#missing[@]}" -gt 0 ]; then
    msg=$(IFS=,; echo "${missing[*]}")
    die "missing: ${msg//,/, }. Install with: apt-get install -y fio fuse3"
fi

SIZE_BYTES=$(python3 "$BENCH_PY" bytes "$SIZE")
QUOTA_BYTES=$(python3 "$BENCH_PY" bytes "$QUOTA")
[ "$SIZE_BYTES" -ge $((4 * 1024 * 1024)) ] || die "SIZE must be at least 4M, got '$SIZE'"
# The random job writes into the sequential job's file, so one file of SIZE is all it holds.
[ "$QUOTA_BYTES" -ge $((2 * SIZE_BYTES)) ] || die "QUOTA ($QUOTA) must be at least 2 x SIZE ($SIZE) so it never fills"

ensure_layerfs "set LAYERFS"

# ---------------------------------------------------------------- scratch area and cleanup
case "$SCRATCH" in /|"") die "refusing SCRATCH='$SCRATCH'" ;; esac
mkdir -p "$SCRATCH"
SCRATCH=$(cd "$SCRATCH" && pwd -P)
RUN=$(mktemp -d "$SCRATCH/quota.XXXXXX")
MNT="$RUN/mnt"
MOUNTED=0
DAEMON_PID=

cleanup() {
    local rc=$? ok=1
    trap - EXIT INT TERM HUP
    set +e
    if [ "$MOUNTED" = 1 ]; then
        for _ in 1 2 3 4 5 6 7 8 9 10; do
            mountpoint -q "$MNT" || break
            umount "$MNT" 2>/dev/null || fusermount3 -u "$MNT" 2>/dev/null
            mountpoint -q "$MNT" || break
            sleep 0.5
        done
        if mountpoint -q "$MNT"; then
            log "mount $MNT busy: lazy unmount"
            umount -l "$MNT" 2>/dev/null || fusermount3 -uz "$MNT" 2>/dev/null
        fi
        mountpoint -q "$MNT" && ok=0
    fi
    if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
        sleep 1
        kill "$DAEMON_PID" 2>/dev/null
    fi
    if [ "$ok" = 1 ]; then
        rm -rf --one-file-system "$RUN"
        rmdir "$SCRATCH" 2>/dev/null
    else
        log "left $RUN in place because $MNT could not be unmounted"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# ---------------------------------------------------------------- mount
log "mounting layerfs over a copy of fixtures/remote in $RUN (SIZE=$SIZE, RUNTIME=$RUNTIME, QUOTA=$QUOTA)"
cp -a "$FIXTURE" "$RUN/remote"
mkdir -p "$RUN/local" "$MNT"
MOUNTED=1
"$LAYERFS" mount --remote "$RUN/remote" --local "$RUN/local" -o "allow_other${OPTS:+,$OPTS}" "$MNT" >&2 \
    || die "layerfs mount failed: $LAYERFS mount --remote $RUN/remote --local $RUN/local -o allow_other $MNT"
for _ in $(seq 50); do mountpoint -q "$MNT" && break; sleep 0.1; done
mountpoint -q "$MNT" || die "$MNT is not a mountpoint after mounting"
DAEMON_PID=$(pgrep -n -f -- " $MNT\$" || true)

Q=overlay/q-bench
P=overlay/plain-bench
mkdir "$MNT/$Q" "$MNT/$P"
ok=0
for _ in $(seq 50); do
    if "$LAYERFS" quota set "$MNT" "$Q" "$QUOTA" >/dev/null 2>"$RUN/quota.err"; then ok=1; break; fi
    sleep 0.1   # the control socket comes up a moment after the mount
done
[ "$ok" = 1 ] || die "layerfs quota set $MNT $Q $QUOTA failed: $(cat "$RUN/quota.err")"
roots=$("$LAYERFS" quota list "$MNT" --json \
    | python3 -c 'import json,sys; print(" ".join(q["path"] for q in json.load(sys.stdin)))') \
    || die "layerfs quota list $MNT failed"
[ "$roots" = "$Q" ] || die "expected exactly one quota root ($Q), the mount has: '$roots'"
log "quota root: $("$LAYERFS" quota get "$MNT" "$Q" --json)"

# ---------------------------------------------------------------- workloads
RESULTS="$RUN/results.txt"
: >"$RESULTS"


bench_dir() {
    local where=$1 dir=$2 f
    f="$MNT/$dir/seqwrite.bin"
    sync
    run_fio "$where" seqwrite write bw --filename="$f" --rw=write --bs=1M \
        --size="$SIZE_BYTES" --end_fsync=1
    if [ "$where" = quota ]; then
        # The writes were counted: the quota root's usage holds the file.
        local used
        used=$("$LAYERFS" quota get "$MNT" "$Q" --json \
            | python3 -c 'import json,sys; print(json.load(sys.stdin)["used"])')
        [ "$used" -ge "$SIZE_BYTES" ] || die "$Q: usage $used after writing $SIZE_BYTES bytes: the writes were not counted"
    fi
    # Reads allocate nothing: inside a root they get passthrough like outside one.
    sync
    echo 3 >/proc/sys/vm/drop_caches
    run_fio "$where" seqread read bw --filename="$f" --rw=read --bs=1M --size="$SIZE_BYTES" --readonly
    run_fio "$where" randread read iops --filename="$f" --rw=randread --bs=4k --size="$SIZE_BYTES" \
        --readonly --invalidate=0 --time_based --runtime="$RUNTIME"
    run_fio "$where" randwrite write iops --filename="$f" --rw=randwrite --bs=4k \
        --size="$SIZE_BYTES" --end_fsync=1 --invalidate=0 --time_based --runtime="$RUNTIME"
    rm -f "$f"
    sync
}

START=$(date +%s)
for round in $(seq "$REPEAT"); do
    log "== round $round of $REPEAT"
    if [ $((round % 2)) = 1 ]; then
        bench_dir plain "$P"; bench_dir quota "$Q"
    else
        bench_dir quota "$Q"; bench_dir plain "$P"
    fi
done
ELAPSED=$(( $(date +%s) - START ))

# ---------------------------------------------------------------- report
fs_type=$(fs_type "$RUN")
cpu_model=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//' || true)
{
    echo "## layerfs quota benchmark"
    echo
    echo "- kernel: $(uname -r) ($(uname -m)); CPUs: $(nproc) ${cpu_model:+($cpu_model)}"
    echo "- local filesystem: $fs_type; fio $(fio --version 2>/dev/null | sed 's/^fio-//')"
    echo "- layerfs: $("$LAYERFS" --version 2>/dev/null | head -n1 || echo unknown)"
    echo "- SIZE=$SIZE RUNTIME=$RUNTIME REPEAT=$REPEAT QUOTA=$QUOTA; ioengine=psync, direct=0, 1 job; medians of $REPEAT round(s)"
    echo "- outside: \`$P\` (no quota); inside: \`$Q\` (quota root); one mount, options: ${OPTS:-the defaults}"
    echo "- wall time: ${ELAPSED}s"
    echo
    python3 - "$RESULTS" <<'EOF'
import statistics, sys
vals = {}
for line in open(sys.argv[1]):
    where, key, v = line.split()
    vals.setdefault((where, key), []).append(float(v))
rows = [("seqwrite", "seq write 1 MiB (+fsync)", "MiB/s", 0.9),
        ("seqread", "seq read 1 MiB, first (cold cache)", "MiB/s", 0.95),
        ("randread", "rand read 4 KiB", "IOPS", 0.95),
        ("randwrite", "rand write 4 KiB (+fsync)", "IOPS", None)]
print("| workload | unit | outside quota | inside quota | inside / outside | DESIGN §10 |")
print("|---|---|---:|---:|---:|---|")
for key, label, unit, target in rows:
    out = statistics.median(vals[("plain", key)])
    ins = statistics.median(vals[("quota", key)])
    r = ins / out if out else float("nan")
    tgt = "n/a" if target is None else ("≥ %.2f %s" % (target, "✓" if r >= target else "✗"))
    print("| %s | %s | %.1f | %.1f | %.2f | %s |" % (label, unit, out, ins, r, tgt))
EOF
}
