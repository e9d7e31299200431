# Shared by the conformance-suite scripts in this directory (sourced, not run).
#
# Gives: a cleanup stack run on every exit (mounts first, then temp dirs), a staged copy of
# the layerfs binary (a rebuild during a run does not change what is under test), fresh
# remote/local trees, mounting a view in a given configuration (transport, passthrough) and
# unmounting it even when it is stuck, and the test area (root or shared) inside a view.

suites_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$suites_dir/../.." && pwd)
prog=$(basename "$0")
uring_param=/sys/module/fuse/parameters/enable_uring

die() {
    echo "$prog: $*" >&2
    exit 1
}

log() {
    echo "$prog: $*" >&2
}

need_root() {
    [ "$(id -u)" = 0 ] || die "mounts filesystems and switches users: run as root"
}

# require_env VAR WHAT: VAR must be set; WHAT says what it should point at.
require_env() {
    [ -n "${!1:-}" ] || die "set $1 to $2"
}

# ---- cleanup stack: commands run in reverse order on exit, whatever the exit ----

_cleanup=()
at_exit() {
    _cleanup+=("$*")
}

# run_in DIR CMD...: runs CMD in DIR, in a session of its own, and waits for it. A signal to
# this script is handled at once (bash runs traps only between foreground commands), and the
# exit ends CMD's whole process group before anything is unmounted.
CHILD=
run_in() {
    local dir=$1 rc=0
    shift
    (cd "$dir" && exec setsid -w "$@") &
    CHILD=$!
    wait "$CHILD" || rc=$?
    CHILD=
    return $rc
}

# CHILD_GRACE: seconds a child has to end after SIGTERM before SIGKILL (more for a child that
# is itself one of these scripts and cleans up its mounts).
CHILD_GRACE=10
_kill_child() {
    local i
    [ -n "$CHILD" ] || return 0
    kill -TERM -- "-$CHILD" 2>/dev/null || return 0
    for ((i = 0; i < CHILD_GRACE * 2; i++)); do
        kill -0 -- "-$CHILD" 2>/dev/null || return 0
        sleep 0.5
    done
    kill -KILL -- "-$CHILD" 2>/dev/null
}

_run_cleanup() {
    local status=$? i
    set +e
    trap - EXIT INT TERM HUP
    _kill_child
    for ((i = ${#_cleanup[@]} - 1; i >= 0; i--)); do
        eval "${_cleanup[i]}"
    done
    exit "$status"
}
trap _run_cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# ---- mounts ----

is_mounted() {
    findmnt -rn --mountpoint "$1" >/dev/null 2>&1
}

# The FUSE connection number (the minor of the superblock's device) of the mount at $1.
fuse_conn() {
    awk -v m="$1" '$5 == m { split($3, d, ":"); c = d[2] } END { if (c != "") print c }' \
        /proc/self/mountinfo
}

# abort_fuse MNT: ends the FUSE connection of the mount at MNT; every waiter gets ENOTCONN.
abort_fuse() {
    local c
    c=$(fuse_conn "$1")
    if [ -n "$c" ] && [ -e "/sys/fs/fuse/connections/$c/abort" ]; then
        log "aborting FUSE connection $c of $1"
        echo 1 >"/sys/fs/fuse/connections/$c/abort" || true
    fi
}

# _umount_timed MNT: umount that gives up after 5 s; prints its exit status (124/137: hung).
_umount_timed() {
    (
        timeout -k 1 5 umount "$1" >/dev/null 2>&1
        echo $?
    ) 2>/dev/null
}

# force_unmount MNT: unmounts MNT. Waits for a busy mount for a while, then aborts its FUSE
# connection and detaches it: never leaves it behind. An umount that hangs (a daemon that
# does not answer) is killed after 5 s and the connection aborted at once.
force_unmount() {
    local mnt=$1 i rc
    is_mounted "$mnt" || return 0
    for ((i = 0; i < 20; i++)); do
        rc=$(_umount_timed "$mnt")
        is_mounted "$mnt" || return 0
        [ "$rc" != 124 ] && [ "$rc" != 137 ] || break
        sleep 0.5
    done
    log "$mnt stays busy or does not answer; aborting it"
    abort_fuse "$mnt"
    sleep 0.5
    [ "$(_umount_timed "$mnt")" = 0 ] || umount -l "$mnt" 2>/dev/null || true
    for ((i = 0; i < 10; i++)); do
        is_mounted "$mnt" || return 0
        umount -l "$mnt" 2>/dev/null || break
    done
    ! is_mounted "$mnt" || log "could not unmount $mnt"
}

# ensure_fusectl: /sys/fs/fuse/connections (where FUSE connections are aborted) is mounted
# for the run; unmounted again at exit if this run mounted it.
ensure_fusectl() {
    local d=/sys/fs/fuse/connections
    [ -d "$d" ] || modprobe fuse 2>/dev/null || true
    [ -d "$d" ] || die "$d does not exist (no fuse module?)"
    findmnt -rn --mountpoint "$d" >/dev/null && return 0
    mount -t fusectl fusectl "$d" || die "cannot mount fusectl on $d"
    at_exit "umount '$d' 2>/dev/null || true"
}

# ---- the binary under test ----

LAYERFS=${LAYERFS:-$repo/target/release/layerfs}
case $LAYERFS in /*) ;; *) LAYERFS=$repo/$LAYERFS ;; esac

# stage_layerfs DIR: copies $LAYERFS to DIR/layerfs and sets LFS to it. A binary that is
# missing or half-written (being rebuilt) is waited for, up to 10 minutes.
stage_layerfs() {
    local dir=$1 deadline=$((SECONDS + 600)) s1 s2
    LFS=$dir/layerfs
    while :; do
        if [ -x "$LAYERFS" ]; then
            s1=$(stat -c %s.%Y "$LAYERFS" 2>/dev/null || true)
            sleep 1
            s2=$(stat -c %s.%Y "$LAYERFS" 2>/dev/null || true)
            if [ -n "$s1" ] && [ "$s1" = "$s2" ] && cp "$LAYERFS" "$LFS" 2>/dev/null &&
                "$LFS" --version >/dev/null 2>&1; then
                return 0
            fi
        fi
        [ $SECONDS -lt $deadline ] || die "no usable layerfs binary at $LAYERFS (set LAYERFS)"
        log "waiting for $LAYERFS (missing or being rebuilt)"
        sleep 5
    done
}

# ---- configuration: TRANSPORT, PASSTHROUGH, AREA ----

check_knobs() {
    case $TRANSPORT in dev | uring) ;; *) die "TRANSPORT must be dev or uring, not '$TRANSPORT'" ;; esac
    case $PASSTHROUGH in on | off) ;; *) die "PASSTHROUGH must be on or off, not '$PASSTHROUGH'" ;; esac
    case $AREA in root | shared) ;; *) die "AREA must be root or shared, not '$AREA'" ;; esac
}

# enable_uring: turns the fuse module's enable_uring on until exit (restores the old value).
enable_uring() {
    [ -e "$uring_param" ] ||
        die "TRANSPORT=uring: $uring_param does not exist (kernel without FUSE over io_uring); not falling back to /dev/fuse"
    local old
    old=$(cat "$uring_param")
    at_exit "echo '$old' >'$uring_param'"
    echo Y >"$uring_param" || die "cannot write $uring_param"
    [ "$(cat "$uring_param")" = Y ] || die "$uring_param did not turn on"
}

# The -o list for a configuration, after the base options given as $1.
view_options() {
    local o=$1
    [ "$PASSTHROUGH" = on ] && o+=,passthrough || o+=,nopassthrough
    [ "$TRANSPORT" = uring ] && o+=,io_uring || o+=,noio_uring
    echo "$o"
}

# make_trees DIR: DIR/remote (a copy of the fixture remote), DIR/local and DIR/mnt.
make_trees() {
    local dir=$1
    cp -a "$repo/fixtures/remote" "$dir/remote"
    mkdir -p -m 0755 "$dir/local" "$dir/mnt"
}

# mount_view DIR OPTIONS: mounts DIR/remote + DIR/local at DIR/mnt, and checks that the
# requests come through the transport asked for.
mount_view() {
    local dir=$1 opts=$2 how
    "$LFS" mount --remote "$dir/remote" --local "$dir/local" -o "$opts" "$dir/mnt" ||
        die "mount failed (options $opts)"
    how=$("$LFS" status "$dir/mnt" | awk '$1 == "requests" { $1 = ""; sub(/^ +/, ""); print }')
    case $TRANSPORT:$how in
    uring:*io_uring*) ;;
    uring:*) die "asked for io_uring but requests come $how" ;;
    dev:*io_uring*) die "asked for /dev/fuse but requests come $how" ;;
    esac
}

# area_base MNT: where tests run in this configuration's AREA (echoes the path).
area_base() {
    local mnt=$1 id
    if [ "$AREA" = root ]; then
        echo "$mnt"
        return
    fi
    id=${LAYER:-}
    if [ -z "$id" ]; then
        id=$("$LFS" layers "$mnt" --json | grep -oE '"id": *"[0-9a-f]{64}"' | head -1 |
            grep -oE '[0-9a-f]{64}') || true
    fi
    [ -n "$id" ] || die "no ready layer in the view at $mnt"
    [ -d "$mnt/overlay/RO/$id/diff" ] || die "$mnt/overlay/RO/$id/diff is not a directory"
    echo "$mnt/overlay/RO/$id/diff"
}

# out_dir PREFIX: makes OUT absolute, a new temp dir named after PREFIX if it is unset.
out_dir() {
    if [ -z "${OUT:-}" ]; then
        OUT=$(mktemp -d "${TMPDIR:-/tmp}/$1.XXXXXX")
        log "results in $OUT"
    fi
    mkdir -p "$OUT"
    OUT=$(cd "$OUT" && pwd)
}

# run_matrix HEADER MISSING: runs this script once per TRANSPORT x PASSTHROUGH x AREA, each
# writing its summary row, and gathers the rows in MATRIX_TABLE ($OUT/matrix.tsv) under the
# tab-separated HEADER; MISSING (tab-separated) stands after the three knobs of a
# configuration that wrote no row. MATRIX_STATUS is 1 if any configuration failed.
run_matrix() {
    local t p a sum
    CHILD_GRACE=120 # a configuration being stopped unmounts and cleans up first
    MATRIX_TABLE=$OUT/matrix.tsv
    MATRIX_STATUS=0
    printf '%s\n' "$1" >"$MATRIX_TABLE"
    for t in dev uring; do
        for p in on off; do
            for a in root shared; do
                sum=$OUT/summary-$t-$p-$a.tsv
                rm -f "$sum"
                run_in "$PWD" env MATRIX=0 TRANSPORT=$t PASSTHROUGH=$p AREA=$a OUT="$OUT" \
                    SUMMARY_TSV="$sum" bash "$suites_dir/$prog" || MATRIX_STATUS=1
                if [ -s "$sum" ]; then
                    cat "$sum" >>"$MATRIX_TABLE"
                else
                    printf '%s\t%s\t%s\t%s\n' "$t" "$p" "$a" "$2" >>"$MATRIX_TABLE"
                fi
            done
        done
    done
}

# workdir VAR PREFIX: sets VAR to a new temp dir under $WORKDIR (default /var/tmp; it should
# not be tmpfs), removed at exit (never through a mount left inside it).
workdir() {
    local base=${WORKDIR:-/var/tmp} d
    [ "$(stat -f -c %T "$base")" != tmpfs ] || log "warning: $base is tmpfs; local should be on a disk filesystem"
    d=$(mktemp -d "$base/$2.XXXXXX")
    at_exit "rm -rf --one-file-system '$d'"
    chmod 0755 "$d" # the suites switch to other users, who must reach the view inside
    printf -v "$1" %s "$d"
}

# bind_short DIR: bind-mounts DIR at a new short path under /tmp and sets SHORT to it. Socket
# paths are capped at 108 bytes, and a shared area's diff dir is deep; the bind keeps the
# tests in the same directory of the view. Undone by unbind_short, or at exit.
SHORT=
bind_short() {
    SHORT=$(mktemp -d /tmp/lfs.XXXXXX)
    chmod 0755 "$SHORT"
    at_exit "unbind_short"
    mount --bind "$1" "$SHORT" || die "cannot bind $1 at $SHORT"
}

unbind_short() {
    [ -n "$SHORT" ] || return 0
    force_unmount "$SHORT"
    rmdir "$SHORT" 2>/dev/null || log "left $SHORT behind (still mounted?)"
    SHORT=
}

# stop_daemons: waits (up to 15 s) for the daemons of this run's layerfs copy to finish after
# their unmount, then kills those that are left (stuck or stopped), so that nothing holds the
# trees open. Only processes running $LFS, the copy staged for this run, are touched.
stop_daemons() {
    local i p pids
    [ -n "${LFS:-}" ] || return 0
    for ((i = 0; i < 30; i++)); do
        pids=
        for p in /proc/[0-9]*; do
            [ "$(readlink "$p/exe" 2>/dev/null)" = "$LFS" ] && pids+=" ${p#/proc/}"
        done
        [ -n "$pids" ] || return 0
        sleep 0.5
    done
    log "layerfs daemons$pids still running after their unmount: killing them"
    kill -KILL $pids 2>/dev/null
    sleep 1
}
