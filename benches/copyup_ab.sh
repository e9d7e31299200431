#!/bin/bash
# Copy-up of one file, timed for kernel overlayfs and for two layerfs binaries side by side on
# one filesystem, to tell whether a change to layerfs's copy-up pays. See benches/README.md.
# Needs root, /dev/fuse, python3, mkfs.ext4.
#
# Knobs (environment):
#   OLD=PATH       the layerfs binary to compare with (required), e.g. one built from main
#   NEW=target/release/layerfs   the layerfs binary under test
#   N=12           copy-ups per target, each of a file of its own; the order of the three
#                  targets rotates from one copy-up to the next
#   KIND=dense     dense: SIZE bytes of data; sparse: 1 MiB of data every 64 MiB of SIZE
#   SIZE=64M       file size
#   TRUNC=0        1: the copy-up is a rewrite, open(O_WRONLY|O_TRUNC), instead of a 1-byte write
#   IMG=10G        size of the ext4 image the trees live on
#   SCRATCH=/dev/shm/layerfs-ab   where the image goes (in memory by default: no disk noise)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
BENCH_PY="$REPO/benches/bench.py"
NEW=${NEW:-$REPO/target/release/layerfs}
N=${N:-12}
KIND=${KIND:-dense}
SIZE=${SIZE:-64M}
TRUNC=${TRUNC:-0}
IMG=${IMG:-10G}
SCRATCH=${SCRATCH:-/dev/shm/layerfs-ab}
# A ready layer of the fixture; its diff/ is shared by the view.
REL=overlay/RO/ab6e04a0c2e0d4da3c83f5f711fd456cf6a726e0fa999e8aa2ae7edaf3384909/diff/copyup

die() { printf 'copyup_ab: %s\n' "$*" >&2; exit 1; }
# shellcheck source=benches/common.sh
. "$REPO/benches/common.sh"
[ "$(id -u)" = 0 ] || die "needs root (mounts)"
[ -x "${OLD:-}" ] || die "OLD must name a layerfs binary to compare with"
[ -x "$NEW" ] || die "no layerfs binary at $NEW (cargo build --release)"
case $TRUNC in 0) OPEN=() ;; 1) OPEN=(--trunc) ;; *) die "TRUNC is 0 or 1" ;; esac
case $KIND in dense) MAKE=mkdata ;; sparse) MAKE=mksparse ;; *) die "KIND is dense or sparse" ;; esac
[[ "$N" =~ ^[0-9]+$ && "$N" -gt 0 ]] || die "N must be a positive integer"
BYTES=$(python3 "$BENCH_PY" bytes "$SIZE")

TARGETS=(overlayfs old new)
ab_scratch "${TARGETS[@]}"
mkdir -p "$FS/remote/$REL" "$FS/upper" "$FS/work" "$FS/local-old" "$FS/local-new"
for t in "${TARGETS[@]}"; do
    mkdir -p "$FS/$t"
    for i in $(seq "$N"); do python3 "$BENCH_PY" "$MAKE" "$FS/remote/$REL/$t.$i" "$BYTES" >/dev/null; done
done
mount -t overlay overlay -o "lowerdir=$FS/remote,upperdir=$FS/upper,workdir=$FS/work" "$FS/overlayfs"
"$OLD" mount --remote "$FS/remote" --local "$FS/local-old" -o allow_other "$FS/old"
"$NEW" mount --remote "$FS/remote" --local "$FS/local-new" -o allow_other "$FS/new"
sync

declare -A ms
for i in $(seq "$N"); do
    # Whatever drifts with time (this machine's page cache fills slow down for seconds at a
    # time) falls on each target in turn.
    order=("${TARGETS[@]:i%3}" "${TARGETS[@]:0:i%3}")
    for t in "${order[@]}"; do
        # Each copy-up starts from the same memory (see copyup_sample in run.sh).
        python3 "$BENCH_PY" drop || die "cannot drop caches (needs root)"
        ms[$t]+="$(python3 "$BENCH_PY" copyup "$FS/$t/$REL/$t.$i" "${OPEN[@]}") "
    done
done

python3 - "$KIND" "$SIZE" "$TRUNC" "${ms[overlayfs]}" "${ms[old]}" "${ms[new]}" <<'EOF'
import statistics, sys
kind, size, trunc = sys.argv[1:4]
runs = [[float(x) for x in a.split()] for a in sys.argv[4:]]
print(f"copy-up of a {size} {kind} file{' by open(O_TRUNC)' if trunc == '1' else ''}, ms, in the order taken")
for name, ms in zip(["overlayfs", "old", "new"], runs):
    print(f"{name:9} median {statistics.median(ms):7.1f}   " + " ".join(f"{x:.0f}" for x in ms))
base = statistics.median(runs[0])
print(f"vs overlayfs (overlayfs time / target time): old {base / statistics.median(runs[1]):.2f}, "
      f"new {base / statistics.median(runs[2]):.2f}")
EOF
