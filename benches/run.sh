#!/usr/bin/env bash
# Benchmark layerfs against the plain directory, kernel overlayfs and fuse-overlayfs, in one run.
# See benches/README.md.  Needs root, /dev/fuse, fio, fuse-overlayfs, fuse3, python3.
#
# Knobs (environment):
#   SIZE=256M      file size for the fio jobs
#   RUNTIME=10s    duration of the time-based random jobs
#   FILES=10000    files in the metadata workload
#   SCRATCH=/var/tmp/layerfs-bench   scratch area (a per-run subdir is created and removed)
#   SCRATCH_FS=ext4  run on a fresh journaled ext4 made in a loop image inside SCRATCH (default),
#                  or "host" to run on SCRATCH's own filesystem
#   LAYERFS=target/release/layerfs   layerfs binary (built with cargo build --release if missing)
#   TARGETS="plain overlayfs fuse-overlayfs fuse-floor layerfs"   which targets to run, in order;
#                  layerfs-uring is layerfs with -o io_uring (the run turns the fuse module's
#                  enable_uring on and restores it); fuse-floor and fuse-floor-uring are an
#                  in-memory FUSE server that does no filesystem work (benches/uring), over
#                  /dev/fuse and io_uring: the fastest any FUSE filesystem's metadata can be here
#   REPEAT=1       rounds over all targets, interleaved; the report gives medians and spread
#   META_CPU=      the CPU the metadata workload runs on (default: the highest it may use;
#                  "none": unpinned); the servers are never pinned
#   WARMUP=1       unrecorded rounds of the metadata workload on every target before the
#                  measured rounds (0: none)
#   COPYUP_SAMPLES=3  copy-ups of each kind per round, each of a file of its own: one copy-up
#                  is one fsync of 64 MiB, whose time varies by 2x from one to the next
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH_PY="$REPO/benches/bench.py"
FIXTURE="$REPO/fixtures/remote"

SIZE=${SIZE:-256M}
RUNTIME=${RUNTIME:-10s}
FILES=${FILES:-10000}
SCRATCH=${SCRATCH:-/var/tmp/layerfs-bench}
SCRATCH_FS=${SCRATCH_FS:-ext4}
LAYERFS=${LAYERFS:-$REPO/target/release/layerfs}
TARGETS=${TARGETS:-plain overlayfs fuse-overlayfs fuse-floor layerfs}
REPEAT=${REPEAT:-1}
WARMUP=${WARMUP:-1}
COPYUP_SAMPLES=${COPYUP_SAMPLES:-3}
COPYUP_SIZE=$((64 * 1024 * 1024))
SPARSE_SIZE=$((1024 * 1024 * 1024))

# The ready layer whose diff/ holds the read-side data (L4 of the fixture, see fixtures/README.md).
DATA_LAYER=ab6e04a0c2e0d4da3c83f5f711fd456cf6a726e0fa999e8aa2ae7edaf3384909
REL="overlay/RO/$DATA_LAYER/diff/bench"

log() { printf '[bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'bench: %s\n' "$*" >&2; exit 1; }
# shellcheck source=benches/common.sh
. "$REPO/benches/common.sh"

# ---------------------------------------------------------------- arguments and prerequisites
case "${1:-}" in
    -h|--help) print_usage "$0"; exit 0 ;;
    "") ;;
    *) die "unknown argument '$1' (configure with environment variables, see --help)" ;;
esac

read -r -a TARGET_LIST <<<"$TARGETS"
[ "${#TARGET_LIST[@]}" -gt 0 ] || die "TARGETS is empty"
want() { local t; for t in "${TARGET_LIST[@]}"; do [ "$t" = "$1" ] && return 0; done; return 1; }
want_floor() { want fuse-floor || want fuse-floor-uring; }
want_fuse() { want fuse-overlayfs || want layerfs || want layerfs-uring || want_floor; }
want_uring() { want layerfs-uring || want fuse-floor-uring; }
for t in "${TARGET_LIST[@]}"; do
    case "$t" in plain|overlayfs|fuse-overlayfs|layerfs|layerfs-uring|fuse-floor|fuse-floor-uring) ;;
        *) die "unknown target '$t' in TARGETS (known: plain overlayfs fuse-overlayfs layerfs layerfs-uring fuse-floor fuse-floor-uring)" ;;
    esac
done
[[ "$FILES" =~ ^[0-9]+$ && "$FILES" -gt 0 ]] || die "FILES must be a positive integer, got '$FILES'"
[[ "$REPEAT" =~ ^[0-9]+$ && "$REPEAT" -gt 0 ]] || die "REPEAT must be a positive integer, got '$REPEAT'"
[[ "$WARMUP" =~ ^[0-9]+$ ]] || die "WARMUP must be a non-negative integer, got '$WARMUP'"
[[ "$COPYUP_SAMPLES" =~ ^[0-9]+$ && "$COPYUP_SAMPLES" -gt 0 ]] || die "COPYUP_SAMPLES must be a positive integer, got '$COPYUP_SAMPLES'"
[[ "$RUNTIME" =~ ^[0-9]+(ms|s|m)?$ ]] || die "RUNTIME must look like 10s, 30 or 1m, got '$RUNTIME'"
case "$SCRATCH_FS" in ext4|host) ;; *) die "SCRATCH_FS must be ext4 or host, got '$SCRATCH_FS'" ;; esac

missing=()
[ "$(id -u)" -eq 0 ] || missing+=("root (run with sudo)")
command -v python3 >/dev/null || missing+=("python3")
command -v fio >/dev/null || missing+=("fio")
if want_fuse; then
    [ -c /dev/fuse ] || missing+=("/dev/fuse (modprobe fuse)")
    command -v fusermount3 >/dev/null || missing+=("fusermount3 (package fuse3)")
fi
want fuse-overlayfs && { command -v fuse-overlayfs >/dev/null || missing+=("fuse-overlayfs"); }
[ "$SCRATCH_FS" = host ] || command -v mkfs.ext4 >/dev/null || missing+=("mkfs.ext4 (package e2fsprogs; or SCRATCH_FS=host)")
if want overlayfs && ! grep -qw overlay /proc/filesystems; then
    modprobe overlay 2>/dev/null || true
    grep -qw overlay /proc/filesystems || missing+=("kernel overlayfs (modprobe overlay)")
fi
if [ "${#missing[@]}" -gt 0 ]; then
    msg=$(IFS=,; echo "${missing[*]}")
    die "missing: ${msg//,/, }. Install with: apt-get install -y fio fuse-overlayfs fuse3"
fi

SIZE_BYTES=$(python3 "$BENCH_PY" bytes "$SIZE")
[ "$SIZE_BYTES" -ge $((4 * 1024 * 1024)) ] || die "SIZE must be at least 4M, got '$SIZE'"
[ -d "$FIXTURE/overlay/RO/$DATA_LAYER/diff" ] || die "fixture layer $DATA_LAYER not found under fixtures/remote"

if want layerfs || want layerfs-uring; then
    ensure_layerfs "set LAYERFS, or drop layerfs from TARGETS"
fi
if want_floor; then
    ensure_probe "drop fuse-floor and fuse-floor-uring from TARGETS"
fi
URING_PARAM=/sys/module/fuse/parameters/enable_uring
if want_uring; then
    [ -w "$URING_PARAM" ] || die "layerfs-uring, fuse-floor-uring: this kernel has no FUSE over io_uring ($URING_PARAM)"
fi

# ---------------------------------------------------------------- scratch area and cleanup
case "$SCRATCH" in /|"") die "refusing SCRATCH='$SCRATCH'" ;; esac
mkdir -p "$SCRATCH"
SCRATCH=$(cd "$SCRATCH" && pwd -P)
BASE=$(mktemp -d "$SCRATCH/run.XXXXXX")
RUN=$BASE
MOUNTS=()        # mountpoints we made and have not unmounted yet
DAEMON_PIDS=()   # fuse daemons we started (pids), for the last-resort cleanup
CACHES_DROPPED=1

unmount_one() {
    local mp=$1 i
    for i in 1 2 3 4 5 6 7 8 9 10; do
        mountpoint -q "$mp" || return 0
        umount "$mp" 2>/dev/null || fusermount3 -u "$mp" 2>/dev/null || true
        mountpoint -q "$mp" || return 0
        sleep 0.5
    done
    log "mount $mp busy: lazy unmount"
    umount -l "$mp" 2>/dev/null || fusermount3 -uz "$mp" 2>/dev/null || true
    ! mountpoint -q "$mp"
}

cleanup() {
    local rc=$? i ok=1 pid
    trap - EXIT INT TERM HUP
    set +e
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
        unmount_one "${MOUNTS[$i]}" || { ok=0; log "could not unmount ${MOUNTS[$i]}"; }
    done
    MOUNTS=()
    [ -n "${URING_BEFORE:-}" ] && echo "$URING_BEFORE" >"$URING_PARAM"
    for pid in "${DAEMON_PIDS[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then sleep 1; kill "$pid" 2>/dev/null; fi
    done
    if [ "$ok" = 1 ]; then
        # --one-file-system: never descend into a mount that is somehow still there
        rm -rf --one-file-system "$BASE"
        rmdir "$SCRATCH" 2>/dev/null
    else
        log "left $BASE in place because a mount could not be removed"
    fi
    exit "$rc"
}
trap cleanup EXIT
if want_uring; then
    URING_BEFORE=$(cat "$URING_PARAM")
    echo Y >"$URING_PARAM"
fi
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

forget_mount() {
    local mp=$1 i keep=()
    for i in "${MOUNTS[@]}"; do [ "$i" = "$mp" ] || keep+=("$i"); done
    MOUNTS=("${keep[@]+"${keep[@]}"}")
}

# The freeing and the FORGETs a drop sets off would share the CPUs with what comes next, so
# bench.py waits for the machine to settle after it.
drop_caches() {
    if ! python3 "$BENCH_PY" drop; then
        [ "$CACHES_DROPPED" = 0 ] || log "warning: cannot write /proc/sys/vm/drop_caches; 'first read', 'cold stat' and copy-up run with warm caches"
        CACHES_DROPPED=0
    fi
}

# ---------------------------------------------------------------- scratch filesystem
# A fresh journaled ext4 of its own, as a container host's disk would be. Every target then
# starts from the same state, whatever the host's filesystem is doing: on ext4 without a
# journal, for one, every create skips the inodes deleted in the last dirty_expire interval
# (30 s by default), so creates run slower after any mass deletion, another target's or a
# build's.
if [ "$SCRATCH_FS" = ext4 ]; then
    # The copy-up files hold 80 MiB of data a sample, in the remote and in every target.
    image_bytes=$(( SIZE_BYTES * (3 + ${#TARGET_LIST[@]}) + 3 * 1024 * 1024 * 1024
        + COPYUP_SAMPLES * 80 * 1024 * 1024 * (1 + ${#TARGET_LIST[@]}) ))
    truncate -s "$image_bytes" "$BASE/fs.img"
    mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$BASE/fs.img" \
        || die "mkfs.ext4 of the scratch image failed"
    mkdir "$BASE/fs"
    MOUNTS+=("$BASE/fs")
    mount -o loop "$BASE/fs.img" "$BASE/fs" || die "cannot loop-mount the scratch image (or use SCRATCH_FS=host)"
    RUN="$BASE/fs/run"
    mkdir "$RUN"
fi

# ---------------------------------------------------------------- test data
# remote: a copy of the fixture storage root, with the read-side data inside a ready layer's diff/.
# It is the lower dir of overlayfs and fuse-overlayfs and the --remote of layerfs (never written by
# any of them).  plain: a plain copy of the same tree (written in place: it has no lower).
log "preparing data in $RUN (SIZE=$SIZE, copy-up files 64M and 1G sparse)"
REMOTE="$RUN/remote"
cp -a "$FIXTURE" "$REMOTE"
mkdir -p "$REMOTE/$REL"
python3 "$BENCH_PY" mkdata "$REMOTE/$REL/seqread.bin" "$SIZE_BYTES"
for i in $(seq "$COPYUP_SAMPLES"); do
    python3 "$BENCH_PY" mkdata "$REMOTE/$REL/copyup.$i.bin" "$COPYUP_SIZE"
    python3 "$BENCH_PY" mksparse "$REMOTE/$REL/sparse.$i.bin" "$SPARSE_SIZE"
done
if want plain; then
    cp -a "$REMOTE" "$RUN/plain"
fi
RESULTS="$RUN/results.txt"
: >"$RESULTS"

# ---------------------------------------------------------------- targets
# remember the pid of the FUSE daemon serving MNT (its command line ends with MNT), so that
# cleanup can stop it if it outlives its mount
# remember_daemon MOUNTPOINT: the newest process serving it is killed on exit if still there;
# all of them (a kept layerfs mount has its keeper beside its daemon) are whose CPU time the
# metadata workload counts (SERVERS, comma-separated).
remember_daemon() {
    local pid
    pid=$(pgrep -n -f -- " $1\$" || true)
    if [ -n "$pid" ]; then DAEMON_PIDS+=("$pid"); fi
    SERVERS=$(pgrep -f -- " $1\$" | paste -sd, -)
}

# mount_target NAME: mount it (if it is a mount) and set ROOT to the root of the target, where
# $REL and the write dirs live.  Not run in a subshell: MOUNTS must reach the cleanup trap.
ROOT=
# Where the metadata workload reads the target's request counts (a metrics URL or a stats
# file) and which processes serve it ("-": none).
COUNTS=-
SERVERS=-
mount_target() {
    local t=$1 d="$RUN/$1" mnt i
    mnt="$d/mnt"
    COUNTS=- SERVERS=-
    case "$t" in
    plain)
        ROOT="$RUN/plain"
        return 0
        ;;
    overlayfs)
        # Fresh upper and work dirs each round: nothing copied up by an earlier round.
        rm -rf "$d/upper" "$d/work"
        mkdir -p "$d/upper" "$d/work" "$mnt"
        MOUNTS+=("$mnt")
        mount -t overlay overlay -o "lowerdir=$REMOTE,upperdir=$d/upper,workdir=$d/work" "$mnt" \
            || die "kernel overlayfs mount failed (is $SCRATCH on a filesystem usable as an overlay upper dir? set SCRATCH)"
        ;;
    fuse-overlayfs)
        rm -rf "$d/upper" "$d/work"
        mkdir -p "$d/upper" "$d/work" "$mnt"
        MOUNTS+=("$mnt")
        if ! fuse-overlayfs -o "lowerdir=$REMOTE,upperdir=$d/upper,workdir=$d/work" "$mnt" 2>"$d/mount.err"; then
            cat "$d/mount.err" >&2
            die "fuse-overlayfs mount failed"
        fi
        grep -v '^unknown argument ignored: lazytime$' "$d/mount.err" >&2 || true
        remember_daemon "$mnt"
        ;;
    layerfs|layerfs-uring)
        # A fresh local each round; the metrics endpoint counts the requests per workload.
        local extra=
        [ "$t" = layerfs-uring ] && extra=,io_uring
        rm -rf "$d/local"
        mkdir -p "$d/local" "$mnt"
        MOUNTS+=("$mnt")
        METRICS_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        METRICS="http://127.0.0.1:$METRICS_PORT/metrics"
        "$LAYERFS" mount --remote "$REMOTE" --local "$d/local" \
            -o "allow_other,metrics=127.0.0.1:$METRICS_PORT$extra" "$mnt" >&2 \
            || die "layerfs mount failed: $LAYERFS mount --remote $REMOTE --local $d/local -o allow_other $mnt"
        remember_daemon "$mnt"
        COUNTS=$METRICS
        ;;
    fuse-floor|fuse-floor-uring)
        # Served in the foreground until unmounted; as many threads as layerfs has.
        local transport=dev threads
        [ "$t" = fuse-floor-uring ] && transport=uring
        threads=$(nproc)
        [ "$threads" -ge 2 ] || threads=2
        mkdir -p "$mnt"
        MOUNTS+=("$mnt")
        "$PROBE" serve "$mnt" --transport "$transport" --threads "$threads" --timeout 3600 \
            --stats "$d/stats.json" 2>"$d/serve.err" &
        DAEMON_PIDS+=("$!")
        COUNTS=$d/stats.json
        SERVERS=$!
        ;;
    esac
    for i in $(seq 50); do mountpoint -q "$mnt" && break; sleep 0.1; done
    if ! mountpoint -q "$mnt"; then
        [ -f "$d/serve.err" ] && cat "$d/serve.err" >&2
        die "$t: $mnt is not a mountpoint after mounting"
    fi
    case "$t" in fuse-floor*)
        for i in $(seq 50); do [ -f "$COUNTS" ] && break; sleep 0.1; done ;;
    esac
    ROOT="$mnt"
}

unmount_target() {
    local t=$1
    local mnt="$RUN/$t/mnt"
    [ "$t" = plain ] && return 0
    unmount_one "$mnt" || die "could not unmount $mnt"
    forget_mount "$mnt"
}


# counted WHERE KEY CMD...: runs CMD; for layerfs, records the FUSE requests it caused.
counted() {
    local where=$1 key=$2
    shift 2
    if [ "$where" != layerfs ]; then "$@"; return; fi
    python3 "$BENCH_PY" requests "$METRICS" >"$RUN/requests.before"
    "$@"
    echo "$where requests_$key $(python3 "$BENCH_PY" requests "$METRICS" "$RUN/requests.before")" >>"$RESULTS"
}

# record_meta TARGET JSON: the rows of one metadata workload (bench.py meta's output).
record_meta() {
    python3 - "$1" "$2" >>"$RESULTS" <<'EOF'
import json, sys
t, m = sys.argv[1], json.loads(sys.argv[2])
for k in ("create", "stat", "readdir", "unlink"):
    print(t, "meta_" + k, "%.1f" % m[k])
    if k in m.get("requests", {}):
        print(t, "requests_meta_" + k, json.dumps(m["requests"][k]))
    if k in m.get("cpu_us", {}):
        print(t, "cpu_meta_" + k, m["cpu_us"][k])
    if k in m.get("ipis", {}):
        print(t, "ipi_meta_" + k, m["ipis"][k])
EOF
    log "$1 metadata: $2"
}

# copyup_sample TARGET KEY WHAT PATH [ARGS...]: one timed copy-up (bench.py copyup PATH
# ARGS), recorded under KEY and logged with what fresh memory cost right after it. Caches
# are dropped first, outside the requests counted: what earlier samples left cached (a 1 GiB
# sparse file reads as 1 GiB of zeroed pages) made later copy-ups up to 5x slower, on every
# target alike.
copyup_sample() {
    local t=$1 key=$2 what=$3 ms
    shift 3
    drop_caches
    copyup() { ms=$(python3 "$BENCH_PY" copyup "$@") || die "$t: $what failed"; }
    counted "$t" "$key" copyup "$@"
    record "$t" "$key" "$ms"
    log "$t $what: $ms ms (fresh memory: $(python3 "$BENCH_PY" memprobe) ms per 32 MiB)"
}

bench_target() {
    local t=$1 root wdir rfile meta
    log "== $t"
    METRICS=
    mount_target "$t"
    root=$ROOT
    case "$t" in fuse-floor*)
        # One flat in-memory directory: the metadata rows only, in its root.
        meta=$(python3 "$BENCH_PY" meta "$root" "$FILES" "$COUNTS" "$SERVERS") || die "$t: metadata workload failed"
        record_meta "$t" "$meta"
        unmount_target "$t"
        return
        ;;
    esac
    rfile="$root/$REL/seqread.bin"
    [ -f "$rfile" ] || die "$t: read-side data not visible at $rfile"
    wdir="$root/bench-write.$t"
    mkdir "$wdir"

    # sequential read of a file in the lower/remote: cold, then again with a warm cache
    drop_caches
    counted "$t" seqread_first run_fio "$t" seqread_first read bw --filename="$rfile" --rw=read --bs=1M --size="$SIZE_BYTES" \
        --readonly --invalidate=1
    counted "$t" seqread_again run_fio "$t" seqread_again read bw --filename="$rfile" --rw=read --bs=1M --size="$SIZE_BYTES" \
        --readonly --invalidate=0
    # random 4 KiB reads of the same (lower/remote) file
    counted "$t" randread run_fio "$t" randread read iops --filename="$rfile" --rw=randread --bs=4k --size="$SIZE_BYTES" \
        --readonly --invalidate=0 --time_based --runtime="$RUNTIME"
    # sequential write of a new file, then random 4 KiB writes into it
    sync
    counted "$t" seqwrite run_fio "$t" seqwrite write bw --filename="$wdir/seqwrite.bin" --rw=write --bs=1M \
        --size="$SIZE_BYTES" --end_fsync=1
    counted "$t" randwrite run_fio "$t" randwrite write iops --filename="$wdir/seqwrite.bin" --rw=randwrite --bs=4k \
        --size="$SIZE_BYTES" --end_fsync=1 --invalidate=0 --time_based --runtime="$RUNTIME"
    rm -f "$wdir/seqwrite.bin"
    sync

    # metadata
    meta=$(python3 "$BENCH_PY" meta "$wdir/meta" "$FILES" "$COUNTS" "$SERVERS") || die "$t: metadata workload failed"
    record_meta "$t" "$meta"

    # copy-up: first 1-byte write into a 64 MiB file of the lower/remote, then the same into
    # a 1 GiB sparse file (16 MiB of data): layerfs must keep the holes (others that fill
    # them get a warning in the log)
    local i strict=
    case "$t" in layerfs*) strict=--strict ;; esac
    for i in $(seq "$COPYUP_SAMPLES"); do
        copyup_sample "$t" copyup_ms "copy-up $i" "$root/$REL/copyup.$i.bin"
        copyup_sample "$t" copyup_sparse_ms "sparse copy-up $i" "$root/$REL/sparse.$i.bin" $strict
    done

    rm -rf "$wdir"
    unmount_target "$t"
}

# The metadata workload once on a target, its figures thrown away. A run's first round
# otherwise pays for what only a first use costs (the floor over io_uring once took 22 µs a
# create in a run's first round and 16.6–17.1 in the five after it), which no later round
# of that target repeats.
warm_target() {
    local t=$1 dir
    log "== $t (warm-up)"
    METRICS=
    mount_target "$t"
    dir=$ROOT
    case "$t" in fuse-floor*) ;; *) dir=$ROOT/bench-warm.$t ;; esac
    python3 "$BENCH_PY" meta "$dir" "$FILES" >/dev/null || die "$t: warm-up failed"
    [ "$dir" = "$ROOT" ] || rm -rf "$dir"
    unmount_target "$t"
}

START=$(date +%s)
for round in $(seq "$WARMUP"); do
    log "warm-up $round of $WARMUP"
    for t in "${TARGET_LIST[@]}"; do
        warm_target "$t"
    done
done
for round in $(seq "$REPEAT"); do
    [ "$REPEAT" = 1 ] || log "round $round of $REPEAT"
    for t in "${TARGET_LIST[@]}"; do
        bench_target "$t"
    done
done
ELAPSED=$(( $(date +%s) - START ))

# ---------------------------------------------------------------- report
fs_type=$(fs_type "$RUN")
[ "$SCRATCH_FS" = host ] || fs_type="$fs_type (fresh, journaled, in a loop image on $(fs_type "$BASE"))"
cpu_model=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//' || true)
mem_gib=$(awk '/MemTotal/ {printf "%.1f", $2 / 1048576}' /proc/meminfo)
{
    echo "## layerfs benchmark"
    echo
    echo "- kernel: $(uname -r) ($(uname -m)); CPUs: $(nproc) ${cpu_model:+($cpu_model)}; memory: ${mem_gib} GiB"
    idle=$(idle_policy)
    [ -z "$idle" ] || echo "- idle CPUs: $idle"
    echo "- scratch filesystem: $fs_type; fio $(fio --version 2>/dev/null | sed 's/^fio-//')"
    want fuse-overlayfs && echo "- fuse-overlayfs: $(fuse-overlayfs --version 2>/dev/null | sed -n 's/^fuse-overlayfs: *//p' | head -n1)"
    want layerfs && echo "- layerfs: $("$LAYERFS" --version 2>/dev/null | head -n1 || echo unknown)"
    echo "- SIZE=$SIZE RUNTIME=$RUNTIME FILES=$FILES REPEAT=$REPEAT WARMUP=$WARMUP META_CPU=${META_CPU:-highest} TARGETS=\"${TARGET_LIST[*]}\"; ioengine=psync, direct=0, 1 job"
    [ "$CACHES_DROPPED" = 1 ] || echo "- WARNING: caches could not be dropped: 'first read', 'cold stat' and copy-up were warm"
    echo "- wall time: ${ELAPSED}s"
    echo
    python3 "$BENCH_PY" report "$RESULTS" "${TARGET_LIST[@]}"
}
