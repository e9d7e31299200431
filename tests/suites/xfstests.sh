#!/usr/bin/env bash
# Runs xfstests (kdave/xfstests) against layerfs: FSTYP=fuse, FUSE_SUBTYP=.layerfs, TEST_DEV and
# SCRATCH_DEV are source names that a mount.fuse.layerfs helper (installed in /sbin for the
# run, removed after) maps to a remote+local pair on a loop-mounted ext4 image of its own.
# See tests/suites/README.md.
#
#   XFSTESTS=/path/to/xfstests   a built xfstests checkout (make) (required). Its common/rc
#                                gets a one-line change (idempotent): _fs_type maps
#                                fuse.layerfs to fuse, as it does fuse.glusterfs
#   TESTS="-g quick"             what to run: check's arguments (groups, test names, -x ...)
#   EXCLUDE="generic/062 ..."    tests not to run (check -e)
#   EXTRA_OPTS=nopassthrough     more layerfs mount options (comma separated), after
#                                allow_other,suid,dev (as a disk filesystem is mounted; nosuid
#                                or nodev here override them); io_uring turns the fuse
#                                module's enable_uring on
#   OUT=dir                      results: check's output, results/, the helper and daemon logs,
#                                the watchdog's log (default: a new temp dir, printed)
#   TIMEOUT=300                  seconds a test may run before the watchdog kills it
#   IMG_SIZE=4G                  size of each sparse image (TEST and SCRATCH)
#   LOCAL_FS=ext4                the filesystem of the images: ext4 or xfs
#   LAYERFS=path                 binary under test (default target/release/layerfs)
#   WORKDIR=/var/tmp             where the images and mountpoints are made
set -euo pipefail
. "$(dirname "$0")/lib.sh"

need_root
ensure_fusectl
require_env XFSTESTS "a built xfstests checkout, e.g. XFSTESTS=/path/to/xfstests"
XFSTESTS=$(cd "$XFSTESTS" && pwd)
[ -x "$XFSTESTS/check" ] || die "XFSTESTS=$XFSTESTS has no check script"
[ -x "$XFSTESTS/ltp/fsstress" ] || die "XFSTESTS=$XFSTESTS is not built (make)"
for c in losetup findmnt truncate; do
    command -v $c >/dev/null || die "$c is missing"
done
for u in fsgqa fsgqa2 123456-fsgqa; do
    id "$u" >/dev/null 2>&1 || log "warning: user $u does not exist; tests that need it will not run"
done
TESTS=${TESTS:--g quick}
EXCLUDE=${EXCLUDE:-}
EXTRA_OPTS=${EXTRA_OPTS:-}
TIMEOUT=${TIMEOUT:-300}
IMG_SIZE=${IMG_SIZE:-4G}
LOCAL_FS=${LOCAL_FS:-ext4}
case $LOCAL_FS in
    ext4 | xfs) command -v "mkfs.$LOCAL_FS" >/dev/null || die "LOCAL_FS=$LOCAL_FS needs mkfs.$LOCAL_FS" ;;
    *) die "LOCAL_FS must be ext4 or xfs" ;;
esac
[[ $TIMEOUT =~ ^[1-9][0-9]*$ ]] || die "TIMEOUT must be a number of seconds"
base_opts=allow_other,suid,dev${EXTRA_OPTS:+,$EXTRA_OPTS}
helper=/sbin/mount.fuse.layerfs
test_dev=lfs_test
scratch_dev=lfs_scratch

out_dir layerfs-xfstests-out

# ---- xfstests' _fs_type: df -T says fuse.layerfs, xfstests expects FSTYP (fuse) ----
rc_file=$XFSTESTS/common/rc
if ! grep -q "s/fuse\.layerfs/fuse/" "$rc_file"; then
    grep -q "\-e 's/fuse.ceph-fuse/ceph-fuse/'" "$rc_file" ||
        die "$rc_file: cannot find _fs_type's fuse.ceph-fuse mapping to add fuse.layerfs next to it"
    sed -i "s|-e 's/fuse.ceph-fuse/ceph-fuse/'|-e 's/fuse.ceph-fuse/ceph-fuse/' -e 's/fuse.layerfs/fuse/'|" "$rc_file"
    log "patched $rc_file: _fs_type maps fuse.layerfs to fuse"
fi

# ---- trees: one image per device, holding its remote (a fixture copy) and local ----
workdir W layerfs-xfstests
stage_layerfs "$W"
state=$W/state
mkdir -p "$state/dev" "$state/opts" "$OUT/logs"
for d in test scratch; do
    truncate -s "$IMG_SIZE" "$W/$d.img"
    case $LOCAL_FS in
        ext4) mkfs.ext4 -q -F -E nodiscard "$W/$d.img" ;;
        xfs) mkfs.xfs -q -f -K "$W/$d.img" ;;
    esac
    mkdir "$W/$d-fs"
    at_exit "force_unmount '$W/$d-fs'"
    mount -o loop "$W/$d.img" "$W/$d-fs"
    cp -a "$repo/fixtures/remote" "$W/$d-fs/remote"
    mkdir -m 0755 "$W/$d-fs/local"
    printf 'remote=%q\nlocal=%q\n' "$W/$d-fs/remote" "$W/$d-fs/local" >"$state/dev/lfs_$d"
    mkdir -m 0755 "$W/$d"
done
if [[ ,$EXTRA_OPTS, == *,io_uring,* ]]; then
    TRANSPORT=uring
    enable_uring
else
    TRANSPORT=dev
fi

# ---- the mount helper ----
# remove_helper: takes this run's helper out of /sbin (and puts back one that was there), but
# never removes a helper another program has put in its place meanwhile.
remove_helper() {
    if [ -e "$helper" ] && ! cmp -s "$helper" "$W/helper"; then
        log "$helper is not this run's helper any more (another program replaced it): left alone"
        return
    fi
    if [ -e "$W/saved-helper" ] || [ -L "$W/saved-helper" ]; then
        mv -f "$W/saved-helper" "$helper"
    else
        rm -f "$helper"
    fi
}
if [ -e "$helper" ] || [ -L "$helper" ]; then
    mv "$helper" "$W/saved-helper"
    log "moved the installed $helper aside for the run"
fi
at_exit remove_helper
sed -e "s|@STATE@|$state|" -e "s|@LFS@|$LFS|" -e "s|@BASE_OPTS@|$base_opts|" \
    -e "s|@LOGS@|$OUT/logs|" >"$helper" <<'HELPER'
#!/bin/bash
# mount.fuse.layerfs for layerfs's tests/suites/xfstests.sh: installed for one run, removed
# after. Maps the source names to remote+local pairs and mounts them with layerfs (fsname =
# the source name, as xfstests looks mounts up by it). "-o remount,..." unmounts and mounts
# the same trees with the changed options; while the mount is busy, options the VFS owns
# (ro/rw, noexec, sync, atime...) change by a kernel remount instead.
set -uo pipefail
STATE='@STATE@'
LFS='@LFS@'
BASE_OPTS='@BASE_OPTS@'
LOGS='@LOGS@'
me=mount.fuse.layerfs

note() { echo "$(date +%T.%3N) $*" >>"$STATE/helper.log"; }
fail() {
    echo "$me: $*" >&2
    note "  failed: $*"
    exit 32
}

[ $# -ge 2 ] || fail "usage: $me SOURCE MOUNTPOINT [-o OPTIONS]"
src=$1 mnt=$2
shift 2
given=
while [ $# -gt 0 ]; do
    case $1 in
    -o) given+=${given:+,}${2:-}; shift; [ $# -gt 0 ] && shift ;;
    -o?*) given+=${given:+,}${1#-o}; shift ;;
    -t) shift; [ $# -gt 0 ] && shift ;;
    *) shift ;; # -n -s -v -f -i
    esac
done
note "$src $mnt -o $given"
[ -f "$STATE/dev/$src" ] || fail "unknown source '$src' (known: $(ls "$STATE/dev" | tr '\n' ' '))"
. "$STATE/dev/$src"

# Options that set the same thing share a key; a later one replaces an earlier one.
key() {
    case $1 in
    ro | rw) echo rw ;;
    atime | noatime | relatime | norelatime | strictatime | nostrictatime) echo atime ;;
    sync | async) echo sync ;;
    *=*) echo "${1%%=*}" ;;
    no*) echo "${1#no}" ;;
    *) echo "$1" ;;
    esac
}
# Options that are the VFS's alone (layerfs does not take them): set by a kernel remount.
vfs_only() {
    case $1 in
    exec | noexec | sync | async | dirsync | lazytime | nolazytime | mand | nomand | iversion | noiversion | silent | loud) return 0 ;;
    esac
    return 1
}
# Options for mount(8) or the kernel's view of the mount, not for layerfs: dropped.
ignored() {
    case $1 in
    '' | remount | defaults | auto | noauto | user | nouser | users | owner | group | nofail | _netdev | \
        x-* | comment=* | user_id=* | group_id=* | rootmode=* | fd=* | fsname=* | subtype=* | \
        default_permissions | blksize=* | max_read=* | log_file=*) return 0 ;;
    esac
    return 1
}
# merge BASE NEW: BASE with every option of NEW applied over it.
merge() {
    local -a out=()
    local o n k keep
    IFS=, read -ra cur <<<"$1"
    out=("${cur[@]}")
    IFS=, read -ra add <<<"$2"
    for n in "${add[@]}"; do
        ignored "$n" && continue
        k=$(key "$n")
        keep=()
        for o in "${out[@]}"; do
            [ "$(key "$o")" = "$k" ] || keep+=("$o")
        done
        out=("${keep[@]}" "$n")
    done
    local IFS=,
    echo "${out[*]}"
}
canon() { tr , '\n' <<<"$1" | grep -v '^$' | sort | tr '\n' ,; }

# Flags the kernel knows for every filesystem: one that layerfs does not take is set by a
# kernel remount after the mount instead.
vfs_flag() {
    case $1 in
    ro | rw | suid | nosuid | dev | nodev | atime | noatime | diratime | nodiratime | relatime | \
        norelatime | strictatime | nostrictatime) return 0 ;;
    esac
    vfs_only "$1"
}

mount_it() { # mount_it OPTIONS
    local -a lfs=() vfs=() keep
    local o out bad i
    IFS=, read -ra all <<<"$1"
    for o in "${all[@]}"; do
        if vfs_only "$o"; then vfs+=("$o"); else lfs+=("$o"); fi
    done
    for ((i = 0; ; i++)); do
        out=$(IFS=,; "$LFS" mount --remote "$remote" --local "$local" \
            -o "${lfs[*]}${lfs[*]:+,}fsname=$src,log_file=$LOGS/daemon-$src.log" "$mnt" 2>&1) && break
        bad=$(sed -n "s/.*unknown mount option '\([^']*\)'.*/\1/p" <<<"$out" | head -1)
        if [ $i -lt 10 ] && [ -n "$bad" ] && vfs_flag "$bad"; then
            keep=()
            for o in "${lfs[@]}"; do [ "$o" = "$bad" ] || keep+=("$o"); done
            lfs=("${keep[@]}")
            vfs+=("$bad")
            note "  layerfs does not take $bad: a kernel remount sets it"
            continue
        fi
        fail "$out"
    done
    if [ ${#vfs[@]} -gt 0 ]; then
        o=$(IFS=,; echo "${vfs[*]}")
        mount -i -o "remount,$o" "$mnt" || fail "kernel remount $o of $mnt failed"
    fi
    echo "$1" >"$STATE/opts/$src"
}

if [[ ,$given, != *,remount,* ]]; then
    mount_it "$(merge "" "$BASE_OPTS,$given")"
    exit 0
fi

# -o remount,...
findmnt -rn --mountpoint "$mnt" >/dev/null || fail "$mnt is not mounted"
cur=$(cat "$STATE/opts/$src" 2>/dev/null || merge "" "$BASE_OPTS")
new=$(merge "$cur" "$given")
if [ "$(canon "$new")" = "$(canon "$cur")" ]; then
    note "  remount: nothing changes"
    exit 0
fi
if umount "$mnt" 2>/dev/null; then
    note "  remount: unmounted; mounting with $new"
    mount_it "$new"
    exit 0
fi
# Busy: what the VFS owns can still change.
changed=()
IFS=, read -ra list <<<"$new"
for o in "${list[@]}"; do
    [[ ,$cur, == *,$o,* ]] && continue
    case $(key "$o") in
    rw | exec | sync | dirsync | lazytime | mand | iversion | atime | diratime) changed+=("$o") ;;
    *) fail "$mnt is busy: cannot change $o without unmounting it" ;;
    esac
done
IFS=,
mount -i -o "remount,${changed[*]}" "$mnt" || fail "kernel remount ${changed[*]} of busy $mnt failed"
note "  remount: busy; kernel remount ${changed[*]}"
echo "$new" >"$STATE/opts/$src"
HELPER
chmod 0755 "$helper"
cp "$helper" "$W/helper"

# ---- preflight: the helper mounts, remounts and shows the right type ----
at_exit stop_daemons
at_exit "force_unmount '$W/scratch'"
at_exit "force_unmount '$W/test'"
mount -t fuse.layerfs -o "$base_opts" "$test_dev" "$W/test" || die "preflight: mounting $test_dev failed"
[ "$(findmnt -rn -o FSTYPE --mountpoint "$W/test")" = fuse.layerfs ] || die "preflight: $W/test is not fuse.layerfs"
mount -o remount,ro "$test_dev" && [ "$(findmnt -rn -o OPTIONS --mountpoint "$W/test" | cut -d, -f1)" = ro ] ||
    die "preflight: remount,ro of $test_dev did not make it read-only (see $state/helper.log)"
mount -o remount,rw "$test_dev" && [ "$(findmnt -rn -o OPTIONS --mountpoint "$W/test" | cut -d, -f1)" = rw ] ||
    die "preflight: remount,rw of $test_dev did not make it writable (see $state/helper.log)"
how=$("$LFS" status "$W/test" | awk '$1 == "requests" { $1 = ""; sub(/^ +/, ""); print }')
case $TRANSPORT:$how in
uring:*io_uring*) ;;
uring:*) die "asked for io_uring but requests come $how" ;;
esac
log "preflight ok: $test_dev on $W/test, layerfs -o $base_opts (requests $how)"

# ---- xfstests' config ----
mkdir -p "$W/no-host-configs"
cat >"$W/local.config" <<EOF
export FSTYP=fuse
export FUSE_SUBTYP=.layerfs
export TEST_DEV=$test_dev
export TEST_DIR=$W/test
export SCRATCH_DEV=$scratch_dev
export SCRATCH_MNT=$W/scratch
export FUSE_MOUNT_OPTIONS="-o $base_opts"
export RESULT_BASE=$OUT/results
EOF
cp "$W/local.config" "$OUT/local.config"

# ---- watchdog: kills a test that runs over TIMEOUT s; aborts the FUSE connections if its
# processes stay stuck (or check itself makes no progress for TIMEOUT s between tests), then
# puts TEST_DEV back ----
unstick() { # unstick REASON: abort both FUSE connections, detach, mount TEST_DEV again
    echo "$(date +%T) $1: aborting the FUSE connections" | tee -a "$OUT/watchdog.log" >&2
    abort_fuse "$W/scratch"
    abort_fuse "$W/test"
    sleep 5
    umount -l "$W/scratch" 2>/dev/null
    if umount -l "$W/test" 2>/dev/null; then
        mount -t fuse.layerfs -o "$base_opts" "$test_dev" "$W/test" &&
            echo "$(date +%T) $test_dev mounted again" | tee -a "$OUT/watchdog.log" >&2
    fi
}

watchdog() {
    set +e
    trap - EXIT INT HUP
    trap 'exit 0' TERM
    local seen= since=0 last= pid name tree p i alive idle=0 size= now swapped=
    while sleep 5; do
        # Another program (a test suite of the repo) may put its own helper in /sbin for a
        # while: tests mounting meanwhile do not test this setup. Say so.
        if ! cmp -s "$helper" "$W/helper"; then
            [ -n "$swapped" ] || echo "$(date +%T) $helper is not this run's helper (replaced or removed by another program): mounts fail or use it until it is back" |
                tee -a "$OUT/watchdog.log" >&2
            swapped=1
        elif [ -n "$swapped" ]; then
            echo "$(date +%T) $helper is this run's helper again" | tee -a "$OUT/watchdog.log" >&2
            swapped=
        fi
        ps -eo pid=,ppid=,args= >"$W/ps.now" 2>/dev/null || continue
        # The test's top process: runs .../tests/<dir>/<n>, its parent does not (subshells do).
        # Its age is measured here, from when this pid first ran this test (ps's own elapsed
        # time is not trusted: a sample taken while a process execs or exits can be wrong).
        pid= name=
        read -r pid name < <(awk '
            function is_test(a) { return a ~ /(^|[ \/])tests\/[^ \/]+\/[0-9]+( |$)/ }
            { args = $0; sub(/^ *[0-9]+ +[0-9]+ +/, "", args); a[$1] = args; pp[$1] = $2 }
            END { for (p in a) if (is_test(a[p]) && !is_test(a[pp[p]])) {
                match(a[p], /tests\/[^ \/]+\/[0-9]+/); print p, substr(a[p], RSTART + 6, RLENGTH - 6) } }
        ' "$W/ps.now" | head -1)
        if [ -n "$pid" ] && [ "$pid $name" != "$seen" ]; then
            seen="$pid $name"
            since=$SECONDS
        fi
        if [ -z "$pid" ]; then
            # Between tests: check itself must make progress.
            now=$(stat -c %s "$OUT/check.out" 2>/dev/null)
            if [ "$now" = "$size" ]; then idle=$((idle + 5)); else idle=0 size=$now; fi
            if [ $idle -gt "$TIMEOUT" ]; then
                unstick "check made no progress for ${idle}s between tests"
                idle=0
            fi
            continue
        fi
        idle=0
        [ $((SECONDS - since)) -gt "$TIMEOUT" ] && [ "$seen" != "$last" ] || continue
        last=$seen
        echo "$(date +%T) $name ran over ${TIMEOUT}s: killing it (pid $pid)" | tee -a "$OUT/watchdog.log" >&2
        tree=$(awk -v root="$pid" '
            { pp[$1] = $2 } END { want[root] = 1; do { n = 0; for (p in pp) if (!(p in want) && (pp[p] in want)) { want[p] = 1; n++ } } while (n)
              for (p in want) print p }' "$W/ps.now")
        tree=$(for p in $tree; do [ "$(readlink "/proc/$p/exe" 2>/dev/null)" = "$LFS" ] || echo "$p"; done)
        kill -TERM $tree 2>/dev/null
        sleep 5
        kill -KILL $tree 2>/dev/null
        for ((i = 0; i < 30; i++)); do
            alive=
            for p in $tree; do kill -0 "$p" 2>/dev/null && alive+=" $p"; done
            [ -n "$alive" ] || break
            sleep 1
        done
        [ -z "$alive" ] || unstick "$name: processes$alive stay stuck"
    done
}
watchdog &
wd=$!
at_exit "kill $wd 2>/dev/null; wait $wd 2>/dev/null"

# ---- run ----
export HOST_OPTIONS=$W/local.config HOST_CONFIG_DIR=$W/no-host-configs
# shellcheck disable=SC2086 # TESTS is check's argument list
set -- $TESTS
[ -z "$EXCLUDE" ] || set -- -e "$EXCLUDE" "$@"
log "running ./check $* (layerfs -o $base_opts; output in $OUT/check.out)"
start=$SECONDS
: >"$OUT/check.out"
tail -n +1 -f "$OUT/check.out" &
tailer=$!
at_exit "kill $tailer 2>/dev/null"
rc=0
run_in "$XFSTESTS" ./check "$@" >"$OUT/check.out" 2>&1 || rc=$?
secs=$((SECONDS - start))
sleep 1
kill $tailer 2>/dev/null || true
cp "$state/helper.log" "$OUT/logs/helper.log" 2>/dev/null || true

# ---- summary ----
line() { sed -nE "s/^$1 *//p" "$OUT/check.out" | tail -1; }
ran=$(line 'Ran:')
notrun=$(line 'Not run:')
failures=$(line 'Failures:')
passed=$(comm -23 <(tr ' ' '\n' <<<"$ran" | grep . | sort) \
    <(tr ' ' '\n' <<<"$notrun $failures" | grep . | sort) | tr '\n' ' ')
count() { wc -w <<<"$1" | tr -d ' '; }
echo
echo "xfstests on layerfs (-o $base_opts; $TESTS${EXCLUDE:+; excluded $EXCLUDE}) in ${secs}s, check exit $rc"
echo "Passed ($(count "$passed")): $passed"
echo "Failed ($(count "$failures")): $failures"
echo "Not run ($(count "$notrun")): $notrun"
[ ! -s "$OUT/watchdog.log" ] || { echo "Watchdog:"; cat "$OUT/watchdog.log"; }
echo "Results: $OUT (check.out, results/, logs/)"
[ -n "$ran" ] && [ -z "$failures" ] && [ "$rc" = 0 ]
