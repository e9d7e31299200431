#!/usr/bin/env bash
# Containers on containerd's own overlayfs snapshotter against the layerfs snapshotter, without
# a quota (its fast path: upper and work dirs on the local disk, only the shared layers read
# through the view) and with one (the dirs in the view, a quota root). Goal: the unlimited
# layerfs snapshotter at >= 0.9x overlayfs (time overlayfs / time layerfs) on every row.
# See benches/README.md. Needs root, /dev/fuse, containerd 1.6+, runc, busybox-static,
# mkfs.ext4, python3 (missing Debian packages are installed with apt-get).
#
# Knobs (environment):
#   REPEAT=5       rounds; each round runs every setup once, the order rotating; medians shown
#   STARTS=10      `ctr run --rm ... true` timed per setup and round
#   FILES=10000    files in the tree that is untarred and removed
#   WRITE_MB=256   MiB written with dd bs=1M conv=fsync
#   QUOTA=2G       layerfs.storage.size of the quota'd setup (must hold the tree and the write)
#   QUICK=1        a fast check: REPEAT=2 STARTS=3 FILES=2000 WRITE_MB=64 unless set
#   SCRATCH=/var/tmp/layerfs-snap-bench   where the per-run ext4 image goes
#   IMG=6G         size of that image (sparse)
#   LAYERFS, SNAPSHOTTER   the binaries; when both are unset the script runs
#                  cargo build --release -p layerfs -p layerfs-snapshotter and uses target/release
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if [ "${QUICK:-0}" = 1 ]; then
    REPEAT=${REPEAT:-2} STARTS=${STARTS:-3} FILES=${FILES:-2000} WRITE_MB=${WRITE_MB:-64}
fi
REPEAT=${REPEAT:-5}
STARTS=${STARTS:-10}
FILES=${FILES:-10000}
WRITE_MB=${WRITE_MB:-256}
QUOTA=${QUOTA:-2G}
SCRATCH=${SCRATCH:-/var/tmp/layerfs-snap-bench}
IMG=${IMG:-6G}
QUOTA_LABEL=containerd.io/snapshot/layerfs.storage.size
IMAGE=docker.io/library/layerfs-bench:busybox
SETUPS=(overlayfs layerfs layerfs-quota)

log() { printf '[snapshotter-ab %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'snapshotter_ab: %s\n' "$*" >&2; exit 1; }
# shellcheck source=benches/common.sh
. "$REPO/benches/common.sh"

case "${1:-}" in
    -h|--help) print_usage "$0"; exit 0 ;;
    "") ;;
    *) die "unknown argument '$1' (configure with environment variables, see --help)" ;;
esac
for n in "$REPEAT" "$STARTS" "$FILES" "$WRITE_MB"; do
    [[ "$n" =~ ^[0-9]+$ && "$n" -gt 0 ]] || die "REPEAT, STARTS, FILES and WRITE_MB must be positive integers"
done
[ "$(id -u)" -eq 0 ] || die "needs root (mounts, containerd)"
[ -c /dev/fuse ] || die "no /dev/fuse (modprobe fuse)"

# ---------------------------------------------------------------- packages and binaries
# The image is made of the host's busybox, so it has to be the static build.
busybox_is_static() {
    [ -x /bin/busybox ] && ! LC_ALL=C ldd /bin/busybox >/dev/null 2>&1
}
pkgs=()
command -v containerd >/dev/null && command -v ctr >/dev/null || pkgs+=(containerd)
command -v runc >/dev/null || pkgs+=(runc)
busybox_is_static || pkgs+=(busybox-static)
command -v mkfs.ext4 >/dev/null || pkgs+=(e2fsprogs)
command -v python3 >/dev/null || pkgs+=(python3)
if [ "${#pkgs[@]}" -gt 0 ]; then
    log "installing ${pkgs[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${pkgs[@]}" >&2 \
        || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y "${pkgs[@]}" >&2; } \
        || die "apt-get install ${pkgs[*]} failed"
fi
busybox_is_static || die "/bin/busybox is not a static binary (install busybox-static)"

if [ -z "${LAYERFS:-}" ] && [ -z "${SNAPSHOTTER:-}" ]; then
    command -v cargo >/dev/null || die "cargo not found (or set LAYERFS and SNAPSHOTTER)"
    log "cargo build --release -p layerfs -p layerfs-snapshotter"
    (cd "$REPO" && cargo build --release -p layerfs -p layerfs-snapshotter) >&2 \
        || die "cargo build failed (or set LAYERFS and SNAPSHOTTER)"
fi
LAYERFS=${LAYERFS:-$REPO/target/release/layerfs}
SNAPSHOTTER=${SNAPSHOTTER:-$REPO/target/release/layerfs-snapshotter}
[ -x "$LAYERFS" ] || die "no layerfs binary at $LAYERFS"
[ -x "$SNAPSHOTTER" ] || die "no layerfs-snapshotter binary at $SNAPSHOTTER"

# ---------------------------------------------------------------- scratch and cleanup
case "$SCRATCH" in /|"") die "refusing SCRATCH='$SCRATCH'" ;; esac
mkdir -p "$SCRATCH"
SCRATCH=$(cd "$SCRATCH" && pwd -P)
RUN=$(mktemp -d "$SCRATCH/run.XXXXXX")
FS=$RUN/fs
MNT=$FS/view
LOCAL=$FS/local
REMOTE=$FS/remote
CDIR=$FS/containerd
SOCK=$CDIR/containerd.sock
SNAP_SOCK=$RUN/snapshotter.sock
DATA=$FS/data
CONTAINERD_PID= SNAP_PID= VIEW_PID=

# stop PID: SIGTERM, up to 20 s, then SIGKILL.
stop() {
    local pid=$1 i
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
    kill "$pid" 2>/dev/null
    for i in $(seq 200); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
}

# Mounts under DIR, deepest first.
mounts_under() {
    awk -v d="$1" '$5 == d || index($5, d "/") == 1 { print $5 }' /proc/self/mountinfo \
        | awk '{ print length($0), $0 }' | sort -rn | cut -d' ' -f2-
}

unmount() {
    local mp=$1 i
    for i in $(seq 50); do
        mountpoint -q "$mp" || return 0
        umount "$mp" 2>/dev/null
        mountpoint -q "$mp" || return 0
        sleep 0.1
    done
    log "$mp busy: lazy unmount"
    umount -l "$mp" 2>/dev/null
    ! mountpoint -q "$mp"
}

cleanup() {
    local rc=$? ok=1 pid mp
    trap - EXIT INT TERM HUP
    set +e
    # A shim outlives containerd; ours are the ones given our socket as their address.
    for pid in /proc/[0-9]*; do
        [[ "$(tr '\0' ' ' 2>/dev/null <"$pid/cmdline")" == *containerd-shim*" -address $SOCK "* ]] \
            && kill -KILL "${pid#/proc/}" 2>/dev/null
    done
    stop "$CONTAINERD_PID"
    # Containers' rootfs mounts first: they hold the view busy.
    for mp in $(mounts_under "$CDIR"); do unmount "$mp" || ok=0; done
    stop "$SNAP_PID"
    if mountpoint -q "$MNT"; then unmount "$MNT" || ok=0; fi
    if [ -n "$VIEW_PID" ] && kill -0 "$VIEW_PID" 2>/dev/null; then sleep 1; stop "$VIEW_PID"; fi
    for mp in $(mounts_under "$FS"); do unmount "$mp" || ok=0; done
    if [ "$ok" = 1 ]; then
        # --one-file-system: never descend into a mount that is somehow still there.
        rm -rf --one-file-system "$RUN"
        rmdir "$SCRATCH" 2>/dev/null
    else
        log "left $RUN in place: a mount could not be removed"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# One fresh journaled ext4 holds containerd's root (the overlayfs snapshotter's dirs), the
# layerfs local dir (the fast path's dirs) and the remote tree, so that every setup writes to
# the same kind of filesystem and none inherits what the host's filesystem went through.
log "scratch: $RUN (ext4 image of $IMG)"
mkdir -p "$FS"
truncate -s "$IMG" "$RUN/image"
mkfs.ext4 -q -F "$RUN/image"
mount -o loop "$RUN/image" "$FS"
mkdir -p "$REMOTE" "$LOCAL" "$MNT" "$CDIR" "$DATA"

# ---------------------------------------------------------------- image, shared tree, data
# A one-layer image of the host's static busybox, as an OCI archive; the same layer on the
# remote tree in iSulad's layout, named by its chain ID; and the tarball of the tree.
log "making the image, the shared tree and a tarball of $FILES files"
python3 - "$RUN/image.tar" "$REMOTE" "$DATA/tree.tar" "$FILES" "$IMAGE" <<'EOF'
import gzip, hashlib, io, json, os, platform, random, subprocess, sys, tarfile
archive, remote, tree_tar, files, name = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]

def info(path, kind, mode, size=0, link=""):
    t = tarfile.TarInfo(path)
    t.type, t.mode, t.size, t.linkname, t.mtime = kind, mode, size, link, 0
    return t

buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
    for d in ("bin", "tmp", "etc", "data"):
        tar.addfile(info(d, tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755))
    busybox = open("/bin/busybox", "rb").read()
    tar.addfile(info("bin/busybox", tarfile.REGTYPE, 0o755, len(busybox)), io.BytesIO(busybox))
    applets = subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True, check=True)
    for a in sorted(set(applets.stdout.split()) - {"busybox"}):
        if "/" not in a and not a.startswith("["):
            tar.addfile(info("bin/" + a, tarfile.SYMTYPE, 0o777, link="busybox"))
layer = buf.getvalue()
diff = hashlib.sha256(layer).hexdigest()

blobs = {}
def put(data):
    digest = hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"digest": "sha256:" + digest, "size": len(data)}
arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
config = json.dumps({"architecture": arch, "os": "linux", "config": {"Cmd": ["/bin/sh"]},
                     "rootfs": {"type": "layers", "diff_ids": ["sha256:" + diff]}}).encode()
manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **put(config)},
                       "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **put(layer)}]}).encode()
index = json.dumps({"schemaVersion": 2, "manifests": [
    {"mediaType": "application/vnd.oci.image.manifest.v1+json", **put(manifest),
     "annotations": {"io.containerd.image.name": name}}]}).encode()
with tarfile.open(archive, "w") as out:
    def add(path, data):
        out.addfile(info(path, tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
    add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
    add("index.json", index)
    for digest, data in blobs.items():
        add("blobs/sha256/" + digest, data)

# A base layer's chain ID is its diff ID.
overlay = os.path.join(remote, "overlay/RO", diff)
meta = os.path.join(remote, "overlay-layers/RO", diff)
for d in ("diff", "work", "empty"):
    os.makedirs(os.path.join(overlay, d))
os.makedirs(meta)
os.makedirs(os.path.join(remote, "overlay-images"))
with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
    tar.extractall(os.path.join(overlay, "diff"),
                   **({"filter": "fully_trusted"} if hasattr(tarfile, "data_filter") else {}))
open(os.path.join(overlay, "link"), "w").write(diff[:26])
json.dump({"id": diff, "diff-digest": "sha256:" + diff, "diff-size": len(layer)},
          open(os.path.join(meta, "layer.json"), "w"))
with gzip.open(os.path.join(meta, diff + ".tar-split.gz"), "wb") as g:
    g.write(b'{"type":1}\n')

# A source tree's shape: 100 files a directory, sizes spread over 0-8 KiB.
rng = random.Random(7)
with tarfile.open(tree_tar, "w", format=tarfile.USTAR_FORMAT) as tar:
    dirs = set()
    for i in range(files):
        d = "tree/d%03d/s%02d" % (i // 1000, (i // 100) % 10)
        parts = d.split("/")
        for k in range(1, len(parts) + 1):
            p = "/".join(parts[:k])
            if p not in dirs:
                dirs.add(p)
                tar.addfile(info(p, tarfile.DIRTYPE, 0o755))
        size = rng.randrange(0, 8192)
        tar.addfile(info("%s/f%05d" % (d, i), tarfile.REGTYPE, 0o644, size), io.BytesIO(os.urandom(size)))
EOF
LAYER_ID=$(ls "$REMOTE/overlay/RO")

# ---------------------------------------------------------------- view, snapshotter, containerd
log "mounting layerfs at $MNT"
"$LAYERFS" mount --remote "$REMOTE" --local "$LOCAL" -o allow_other,suid,dev "$MNT" >&2 \
    || die "layerfs mount failed"
for _ in $(seq 100); do mountpoint -q "$MNT" && break; sleep 0.1; done
mountpoint -q "$MNT" || die "$MNT is not a mountpoint after mounting"
VIEW_PID=$(pgrep -n -f -- " $MNT\$" || true)
for _ in $(seq 100); do [ -e "$MNT/overlay/RO/$LAYER_ID/diff/bin/busybox" ] && break; sleep 0.1; done
[ -e "$MNT/overlay/RO/$LAYER_ID/diff/bin/busybox" ] || die "the view does not show the shared layer $LAYER_ID"

log "starting layerfs-snapshotter"
mkdir -p "$MNT/containerd-snapshots"
LAYERFS_LOG=info "$SNAPSHOTTER" --address "$SNAP_SOCK" --root "$MNT/containerd-snapshots" \
    </dev/null >"$RUN/snapshotter.log" 2>&1 &
SNAP_PID=$!
for _ in $(seq 200); do [ -S "$SNAP_SOCK" ] && break; kill -0 "$SNAP_PID" 2>/dev/null || break; sleep 0.1; done
[ -S "$SNAP_SOCK" ] || { cat "$RUN/snapshotter.log" >&2; die "the snapshotter did not come up"; }

log "starting containerd"
cat >"$CDIR/config.toml" <<EOF
version = 2
root = "$CDIR/root"
state = "$CDIR/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$SOCK"
[proxy_plugins.layerfs]
  type = "snapshot"
  address = "$SNAP_SOCK"
EOF
containerd --config "$CDIR/config.toml" </dev/null >"$RUN/containerd.log" 2>&1 &
CONTAINERD_PID=$!
CTR=$(command -v ctr)
ctr() { timeout 300 "$CTR" -a "$SOCK" "$@"; }
for _ in $(seq 300); do
    kill -0 "$CONTAINERD_PID" 2>/dev/null || break
    [ -S "$SOCK" ] && ctr version >/dev/null 2>&1 && break
    sleep 0.1
done
ctr version >/dev/null 2>&1 || { tail -20 "$RUN/containerd.log" >&2; die "containerd did not come up"; }

# ---------------------------------------------------------------- import
# containerd 1.6's import sends no remote-snapshot label, so layerfs unpacks the layer and,
# at commit, keeps the shared diff instead of its copy: the image runs on the shared layer.
log "importing the image for overlayfs and for layerfs"
ctr images import --snapshotter overlayfs "$RUN/image.tar" >&2 || die "import (overlayfs) failed"
ctr images import --snapshotter layerfs "$RUN/image.tar" >&2 || die "import (layerfs) failed"
if grep -q "dropping the local copy" "$RUN/snapshotter.log"; then
    IMPORT="imported with ctr images import; layerfs's snapshot of the layer is the shared tree's copy"
else
    IMPORT="imported with ctr images import; layerfs did NOT adopt the shared layer (a local copy)"
    log "warning: the layerfs snapshotter kept a local copy of the image's layer"
fi

# ---------------------------------------------------------------- runs
cat "$DATA/tree.tar" >/dev/null
SEQ=0
# snap_args SETUP: the ctr run options that pick its snapshotter.
snap_args() {
    case $1 in
        overlayfs) echo "--snapshotter overlayfs" ;;
        layerfs) echo "--snapshotter layerfs" ;;
        layerfs-quota) echo "--snapshotter layerfs --snapshotter-label $QUOTA_LABEL=$QUOTA" ;;
    esac
}
# run SETUP CMD...: a container of the image, removed when it exits; its stdout.
run() {
    local setup=$1
    shift
    SEQ=$((SEQ + 1))
    # shellcheck disable=SC2046
    ctr run --rm $(snap_args "$setup") \
        --mount "type=bind,src=$DATA,dst=/data,options=rbind:ro" \
        "$IMAGE" "bench-$SEQ" "$@" 2>"$RUN/ctr.err" \
        || { cat "$RUN/ctr.err" >&2; die "$setup: ctr run ($1 ...) failed"; }
}

# Where each setup's upper and lower dirs are, from the container's own root mount, and the
# size `df /` shows in it (the quota's, where there is one); a warm-up.
QUOTA_KIB=$(($(numfmt --from=iec "$QUOTA") / 1024))
PLACES=()
for s in "${SETUPS[@]}"; do
    seen=$(run "$s" sh -c 'cat /proc/self/mountinfo; df -k /')
    opts=$(awk '$5 == "/" { print $NF }' <<<"$seen" | tail -n 1)
    size_kib=$(awk '$NF == "/" { print $2 }' <<<"$seen" | tail -n 1)
    upper=$(tr ',' '\n' <<<"$opts" | sed -n 's/^upperdir=//p')
    lower=$(tr ',' '\n' <<<"$opts" | sed -n 's/^lowerdir=//p')
    case $s in
        overlayfs) want_upper=$CDIR/root/io.containerd.snapshotter.v1.overlayfs/ want_lower=$CDIR/ ;;
        layerfs) want_upper=$LOCAL/.layerfs-snapshotter/ want_lower=$MNT/ ;;
        layerfs-quota) want_upper=$MNT/ want_lower=$MNT/ ;;
    esac
    where_upper=disk where_lower=disk
    [[ "$upper" == "$MNT/"* ]] && where_upper=view
    [[ "$lower" == "$MNT/"* ]] && where_lower=view
    PLACES+=("$s: upper dir on the $where_upper, lower dir on the $where_lower, df / $((size_kib / 1024)) MiB")
    if [[ "$upper" != "$want_upper"* || "$lower" != "$want_lower"* ]]; then
        log "warning: $s: unexpected dirs: upper $upper, lower $lower"
        PLACES[-1]+=" (UNEXPECTED DIRS)"
    fi
    if [[ "$s" == layerfs-quota && "$size_kib" != "$QUOTA_KIB" ]]; then
        log "warning: $s: df / shows $size_kib KiB, not the quota's $QUOTA_KIB"
        PLACES[-1]+=" (NO QUOTA)"
    fi
done

RESULTS=$RUN/results.txt
: >"$RESULTS"
# The untimed syncs keep one phase's writeback out of the next one's time.
WORK='set -e
now() { adjtimex | awk "/tv_sec/ { s = \$2 } /tv_usec/ { u = \$2 } END { printf \"%d%06d\", s, u }"; }
mkdir /w
sync
a=$(now); tar -xf /data/tree.tar -C /w; b=$(now)
sync
c=$(now); dd if=/dev/zero of=/w/big bs=1M count='"$WRITE_MB"' conv=fsync 2>/dev/null; d=$(now)
sync
e=$(now); rm -rf /w/tree; f=$(now)
echo "phases $((b - a)) $((d - c)) $((f - e))"'

log "$REPEAT rounds: untar of $FILES files, write of $WRITE_MB MiB (+fsync), rm -rf; $STARTS starts a setup"
for r in $(seq "$REPEAT"); do
    # Whatever drifts with time (other work on the machine, the disk) falls on each in turn.
    k=$((r % 3))
    order=("${SETUPS[@]:k}" "${SETUPS[@]:0:k}")
    for s in "${order[@]}"; do
        out=$(run "$s" sh -c "$WORK")
        read -r _ untar write remove < <(grep '^phases ' <<<"$out") || die "$s: no timings in: $out"
        echo "$s untar $untar" >>"$RESULTS"
        echo "$s write $write" >>"$RESULTS"
        echo "$s rm $remove" >>"$RESULTS"
        log "round $r $s: untar $((untar / 1000)) ms, write $((write / 1000)) ms, rm $((remove / 1000)) ms"
    done
    for i in $(seq "$STARTS"); do
        for s in "${order[@]}"; do
            t0=$(date +%s%N)
            run "$s" true >/dev/null
            t1=$(date +%s%N)
            echo "$s start $(((t1 - t0) / 1000))" >>"$RESULTS"
        done
    done
done

# ---------------------------------------------------------------- report
python3 - "$RESULTS" "$FILES" "$WRITE_MB" "$QUOTA" "$REPEAT" "$STARTS" "$IMPORT" "${PLACES[@]}" <<'EOF'
import collections, statistics, sys
results, files, write_mb, quota, repeat, starts, imported = sys.argv[1:8]
places = sys.argv[8:]
us = collections.defaultdict(list)
for line in open(results):
    setup, metric, value = line.split()
    us[(setup, metric)].append(int(value) / 1000.0)
setups = ["overlayfs", "layerfs", "layerfs-quota"]
rows = [("untar", f"untar {files} files"), ("write", f"write {write_mb} MiB bs=1M +fsync"),
        ("rm", f"rm -rf {files} files"), ("start", "ctr run --rm ... true")]
print(f"containers: overlayfs snapshotter vs layerfs (unlimited) vs layerfs (quota {quota});"
      f" {repeat} rounds, {starts} starts a setup and round; medians in ms (min-max)")
print(f"image: {imported}")
for p in places:
    print(f"  {p}")
print()
print(f"| {'metric':32} | {'overlayfs':>17} | {'layerfs':>17} | {'layerfs-quota':>17} | ovl/layerfs | ovl/quota |")
print(f"|{'-' * 34}|{'-' * 19}|{'-' * 19}|{'-' * 19}|{'-' * 13}|{'-' * 11}|")
ok = True
for key, label in rows:
    med = {s: statistics.median(us[(s, key)]) for s in setups}
    cell = lambda s: f"{med[s]:.0f} ({min(us[(s, key)]):.0f}-{max(us[(s, key)]):.0f})"
    r1 = med["overlayfs"] / med["layerfs"]
    r2 = med["overlayfs"] / med["layerfs-quota"]
    ok &= r1 >= 0.9
    print(f"| {label:32} | {cell('overlayfs'):>17} | {cell('layerfs'):>17} | {cell('layerfs-quota'):>17} "
          f"| {r1:11.2f} | {r2:9.2f} |")
print()
print("ratios: overlayfs time / layerfs time (> 1.00: layerfs faster)")
print(("PASS" if ok else "FAIL") + ": unlimited layerfs >= 0.90x overlayfs on every row")
EOF
