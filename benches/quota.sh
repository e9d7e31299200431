#!/usr/bin/env bash
# Writes inside a quota root vs outside one, on one layerfs mount per quota backend (DESIGN §10:
# 1 MiB sequential writes inside a quota root >= 0.9x outside, reads as fast; issue 38: with the
# btrfs backend, 4 KiB random writes too). See benches/README.md.
# Needs root, /dev/fuse, fio, fuse3, python3 (and btrfs-progs for LOCAL_FS=btrfs).
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
#   LOCAL_FS=      empty: local is a directory in SCRATCH; btrfs: a fresh btrfs in an image
#                  file in SCRATCH (LOCAL_SIZE=4G), so both backends can run
#   BACKENDS=      quota backends to run, one mount each (quota_backend=); default
#                  "fuse btrfs" with LOCAL_FS=btrfs, else "fuse"
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
LOCAL_FS=${LOCAL_FS:-}
LOCAL_SIZE=${LOCAL_SIZE:-4G}
case "$LOCAL_FS" in
    "") BACKENDS=${BACKENDS:-fuse} ;;
    btrfs) BACKENDS=${BACKENDS:-fuse btrfs} ;;
    *) printf 'quota-bench: LOCAL_FS must be empty or btrfs, got %s\n' "$LOCAL_FS" >&2; exit 1 ;;
esac

log() { printf '[quota-bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'quota-bench: %s\n' "$*" >&2; exit 1; }
# shellcheck source=benches/common.sh
. "$REPO/benches/common.sh"

case "${1:-}" in
    -h|--help) print_usage "$0"; exit 0 ;;
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
[ -z "$LOCAL_FS" ] || command -v mkfs.btrfs >/dev/null || missing+=("mkfs.btrfs (package btrfs-progs)")
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
LOCAL_MOUNTED=0

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
    if [ "$LOCAL_MOUNTED" = 1 ] && [ "$ok" = 1 ]; then
        umount "$RUN/local" 2>/dev/null || umount -l "$RUN/local" 2>/dev/null
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

# ---------------------------------------------------------------- mounts, one per backend
log "layerfs over a copy of fixtures/remote in $RUN (SIZE=$SIZE, RUNTIME=$RUNTIME, QUOTA=$QUOTA, BACKENDS=$BACKENDS)"
cp -a "$FIXTURE" "$RUN/remote"
mkdir -p "$RUN/local" "$MNT"
if [ "$LOCAL_FS" = btrfs ]; then
    truncate -s "$LOCAL_SIZE" "$RUN/local.img"
    mkfs.btrfs -q -f "$RUN/local.img" >/dev/null
    mount -o loop "$RUN/local.img" "$RUN/local"
    LOCAL_MOUNTED=1
fi
RESULTS="$RUN/results.txt"
: >"$RESULTS"

# mount_backend B: mounts the view with quota_backend=B, with a quota root overlay/q-B and a
# plain directory overlay/plain-B; sets Q and P.
mount_backend() {
    local b=$1 ok=0 got
    MOUNTED=1
    "$LAYERFS" mount --remote "$RUN/remote" --local "$RUN/local" \
        -o "allow_other,quota_backend=$b${OPTS:+,$OPTS}" "$MNT" >&2 \
        || die "layerfs mount failed: $LAYERFS mount --remote $RUN/remote --local $RUN/local -o allow_other,quota_backend=$b $MNT"
    for _ in $(seq 50); do mountpoint -q "$MNT" && break; sleep 0.1; done
    mountpoint -q "$MNT" || die "$MNT is not a mountpoint after mounting"
    DAEMON_PID=$(pgrep -n -f -- " $MNT\$" || true)
    Q=overlay/q-$b
    P=overlay/plain-$b
    mkdir "$MNT/$Q" "$MNT/$P"
    for _ in $(seq 50); do
        if "$LAYERFS" quota set "$MNT" "$Q" "$QUOTA" >/dev/null 2>"$RUN/quota.err"; then ok=1; break; fi
        sleep 0.1   # the control socket comes up a moment after the mount
    done
    [ "$ok" = 1 ] || die "layerfs quota set $MNT $Q $QUOTA failed: $(cat "$RUN/quota.err")"
    got=$("$LAYERFS" quota get "$MNT" "$Q" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["backend"])') \
        || die "layerfs quota get $MNT $Q failed"
    [ "$got" = "$b" ] || die "$Q: asked for the $b backend, the mount reports '$got'"
    log "quota root: $("$LAYERFS" quota get "$MNT" "$Q" --json)"
}

unmount_backend() {
    sync
    umount "$MNT" || die "unmounting $MNT failed"
    MOUNTED=0
    if [ -n "$DAEMON_PID" ]; then
        for _ in $(seq 50); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 0.1; done
    fi
    DAEMON_PID=
}

# ---------------------------------------------------------------- workloads
bench_dir() {
    local where=$1 dir=$2 f
    f="$MNT/$dir/seqwrite.bin"
    sync
    run_fio "$where" seqwrite write bw --filename="$f" --rw=write --bs=1M \
        --size="$SIZE_BYTES" --fsync=64 --end_fsync=1
    if [ "${where%%-*}" = quota ]; then
        # The writes were counted: the quota root's usage holds the file (btrfs counts
        # at commit, which the sync makes).
        local used
        sync
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
        --size="$SIZE_BYTES" --fsync=64 --end_fsync=1 --invalidate=0 --time_based --runtime="$RUNTIME"
    rm -f "$f"
    sync
}

START=$(date +%s)
for b in $BACKENDS; do
    mount_backend "$b"
    for round in $(seq "$REPEAT"); do
        log "== $b backend, round $round of $REPEAT"
        if [ $((round % 2)) = 1 ]; then
            bench_dir "plain-$b" "$P"; bench_dir "quota-$b" "$Q"
        else
            bench_dir "quota-$b" "$Q"; bench_dir "plain-$b" "$P"
        fi
    done
    unmount_backend
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
    echo "- local: $(fs_type "$RUN/local"); one mount per backend ($BACKENDS), each with a quota root \`overlay/q-<backend>\` (inside) and a plain \`overlay/plain-<backend>\` (outside); extra options: ${OPTS:-none}"
    echo "- writes: fsync every 64 writes and at the end"
    echo "- wall time: ${ELAPSED}s"
    echo
    python3 - "$RESULTS" $BACKENDS <<'EOF'
import statistics, sys
vals = {}
for line in open(sys.argv[1]):
    where, key, v = line.split()
    vals.setdefault((where, key), []).append(float(v))
backends = sys.argv[2:]
# DESIGN §10 asks 0.9 of sequential writes of every backend; issue 38 asks btrfs roots 0.9 of
# random writes too (the FUSE backend sees every write, and reaches what it reaches).
rows = [("seqwrite", "seq write 1 MiB", "MiB/s", {"fuse": 0.9, "btrfs": 0.9}),
        ("seqread", "seq read 1 MiB, cold", "MiB/s", {"fuse": 0.95, "btrfs": 0.95}),
        ("randread", "rand read 4 KiB", "IOPS", {"fuse": 0.95, "btrfs": 0.95}),
        ("randwrite", "rand write 4 KiB", "IOPS", {"btrfs": 0.9})]
head = "| workload | unit |"
rule = "|---|---|"
for b in backends:
    head += " %s: outside | %s: inside | inside / outside |" % (b, b)
    rule += "---:|---:|---|"
print(head)
print(rule)
for key, label, unit, targets in rows:
    line = "| %s | %s |" % (label, unit)
    for b in backends:
        out = statistics.median(vals[("plain-" + b, key)])
        ins = statistics.median(vals[("quota-" + b, key)])
        r = ins / out if out else float("nan")
        t = targets.get(b)
        mark = "" if t is None else (" (≥ %.2f %s)" % (t, "✓" if r >= t else "✗"))
        line += " %.1f | %.1f | %.2f%s |" % (out, ins, r, mark)
    print(line)
EOF
}
