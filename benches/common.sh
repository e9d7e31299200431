# shellcheck shell=bash
# Shell pieces shared by the benchmarks (sourced, never run). The script that sources this
# file defines log and die, and sets REPO, BENCH_PY, LAYERFS, and RUN and RESULTS before it
# runs any job; the A/B scripts set REPO, SCRATCH and IMG before ab_scratch.

# print_usage SCRIPT: the comment block at the top of SCRIPT (after its first line), which
# documents it and its knobs, without the comment marks.
print_usage() {
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$1"
}

# ensure_layerfs HINT: builds the release binary if LAYERFS is the default one and missing;
# HINT ends the error messages (what the user can do instead).
ensure_layerfs() {
    local hint=$1
    [ -x "$LAYERFS" ] && return 0
    if [ "$LAYERFS" = "$REPO/target/release/layerfs" ]; then
        command -v cargo >/dev/null || die "layerfs binary missing and cargo not found ($hint)"
        log "building layerfs: cargo build --release"
        (cd "$REPO" && cargo build --release) >&2 || die "cargo build --release failed ($hint)"
    fi
    [ -x "$LAYERFS" ] || die "layerfs binary not found at $LAYERFS ($hint)"
}

# ensure_probe HINT: sets PROBE to benches/uring's uring-probe (an in-memory FUSE server,
# the fuse-floor targets), building it first if it is missing.
ensure_probe() {
    local hint=$1
    PROBE="$REPO/benches/uring/target/release/uring-probe"
    [ -x "$PROBE" ] && return 0
    command -v cargo >/dev/null || die "uring-probe missing and cargo not found ($hint)"
    log "building uring-probe: cargo build --release in benches/uring"
    (cd "$REPO/benches/uring" && cargo build --release) >&2 || die "building uring-probe failed ($hint)"
    [ -x "$PROBE" ] || die "uring-probe not found at $PROBE ($hint)"
}

record() { echo "$1 $2 $3" >>"$RESULTS"; }

# idle_policy: how an idle CPU waits (the cpuidle driver and governor, and a guest's halt
# polling window), or nothing where sysfs does not say. On a VM whose idle vCPUs halt at once,
# every wakeup of a thread on an idle CPU is an interrupt the hypervisor delivers, and the
# /dev/fuse rows pay for it (benches/README.md, "/dev/fuse is a question of placement").
idle_policy() {
    local dir=/sys/devices/system/cpu/cpuidle poll=/sys/module/haltpoll/parameters/guest_halt_poll_ns out
    [ -r "$dir/current_driver" ] || return 0
    out="cpuidle $(cat "$dir/current_driver")/$(cat "$dir/current_governor" 2>/dev/null || echo ?)"
    [ -r "$poll" ] && out+=", guest_halt_poll_ns=$(cat "$poll")"
    echo "$out"
}

# fs_type PATH: the type of the filesystem PATH is on, by name (`stat -f` calls ext4
# "ext2/ext3", whose magic it shares).
fs_type() { findmnt -n -o FSTYPE -T "$1" 2>/dev/null | tail -n 1 | grep . || stat -f -c %T "$1"; }

# run_fio WHERE KEY KIND(read|write) FIELD(bw|iops) fio-args...: runs one fio job, logs its
# figure and records "WHERE KEY VALUE".
run_fio() {
    local where=$1 key=$2 kind=$3 field=$4 out bw iops
    shift 4
    out="$RUN/fio-$where-$key.json"
    if ! fio --output-format=json --output="$out" --ioengine=psync --direct=0 --numjobs=1 \
            --name="$key" "$@" >/dev/null 2>"$out.err"; then
        cat "$out.err" >&2
        die "$where: fio $key failed"
    fi
    read -r bw iops < <(python3 "$BENCH_PY" fio "$out" "$kind")
    if [ "$field" = bw ]; then record "$where" "$key" "$bw"; log "$where $key: $bw MiB/s"
    else record "$where" "$key" "$iops"; log "$where $key: $iops IOPS"; fi
}

# ab_scratch MOUNT...: a fresh ext4 of IMG bytes in an image under SCRATCH, mounted at $FS
# with a copy of the fixture remote at $FS/remote (sets D and FS). On exit, $FS/MOUNT for
# each MOUNT, then $FS, are unmounted and the image removed.
ab_scratch() {
    AB_MOUNTS=("$@")
    D=$(mktemp -d "$SCRATCH.XXXXXX")
    FS=$D/fs
    trap ab_cleanup EXIT
    mkdir -p "$FS"
    truncate -s "$IMG" "$D/image"
    # Inode tables and journal written now, not by ext4lazyinit while the rounds run.
    mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$D/image"
    mount -o loop "$D/image" "$FS"
    cp -a "$REPO/fixtures/remote" "$FS/remote"
}

ab_cleanup() {
    local t
    for t in "${AB_MOUNTS[@]}"; do umount "$FS/$t" 2>/dev/null || umount -l "$FS/$t" 2>/dev/null || true; done
    umount "$FS" 2>/dev/null || umount -l "$FS" 2>/dev/null || true
    rm -rf "$D"
}
