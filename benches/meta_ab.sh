#!/bin/bash
# Metadata of two layerfs binaries side by side on one filesystem, with the daemon's CPU time
# and context switches per operation, to tell whether a change to the request path pays.
# See benches/README.md. Needs root, /dev/fuse, python3, mkfs.ext4.
#
# Knobs (environment):
#   OLD=PATH       the layerfs binary to compare with (required), e.g. one built from main
#   NEW=target/release/layerfs   the layerfs binary under test
#   ROUNDS=5       rounds; the order of the two binaries alternates from one round to the next
#   FILES=14000    files created and unlinked a round, in a local directory of the view
#   LAYER_FILES=6000   files stat'ed cold a round inside a remote layer (the remote pool's path)
#   IMG=8G         size of the ext4 image the trees live on
#   SCRATCH=/dev/shm/layerfs-ab   where the image goes (in memory by default: no disk noise)
#   OPTIONS=       more mount options for both, e.g. io_uring (with the fuse module's enable_uring on)
#   NEW_OPTIONS=   more mount options for the new one only, e.g. nopassthrough with OLD=NEW
#                  to measure what an option costs
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
NEW=${NEW:-$REPO/target/release/layerfs}
ROUNDS=${ROUNDS:-5}
FILES=${FILES:-14000}
LAYER_FILES=${LAYER_FILES:-6000}
IMG=${IMG:-8G}
SCRATCH=${SCRATCH:-/dev/shm/layerfs-ab}
# A ready layer of the fixture; the view serves its diff/ from the remote.
REL=overlay/RO/ab6e04a0c2e0d4da3c83f5f711fd456cf6a726e0fa999e8aa2ae7edaf3384909/diff/many

die() { printf 'meta_ab: %s\n' "$*" >&2; exit 1; }
# shellcheck source=benches/common.sh
. "$REPO/benches/common.sh"
[ "$(id -u)" = 0 ] || die "needs root (mounts, drop_caches)"
[ -x "${OLD:-}" ] || die "OLD must name a layerfs binary to compare with"
[ -x "$NEW" ] || die "no layerfs binary at $NEW (cargo build --release)"
for n in "$ROUNDS" "$FILES" "$LAYER_FILES"; do
    [[ "$n" =~ ^[0-9]+$ && "$n" -gt 0 ]] || die "ROUNDS, FILES and LAYER_FILES must be positive integers"
done

BINS=(old new)
ab_scratch "${BINS[@]}"
mkdir -p "$FS/remote/$REL"
python3 - "$FS/remote/$REL" "$LAYER_FILES" <<'EOF'
import os, sys
for i in range(int(sys.argv[2])):
    open(os.path.join(sys.argv[1], "f%06d" % i), "w").close()
EOF
declare -A PID
for t in "${BINS[@]}"; do
    bin=$OLD
    [ "$t" = new ] && bin=$NEW
    mkdir -p "$FS/$t" "$FS/local-$t"
    opts=allow_other${OPTIONS:+,$OPTIONS}
    [ "$t" = new ] && opts+=${NEW_OPTIONS:+,$NEW_OPTIONS}
    "$bin" mount --remote "$FS/remote" --local "$FS/local-$t" -o "$opts" "$FS/$t"
    PID[$t]=$(pgrep -n -f -- " $FS/$t\$") || die "no daemon found for $FS/$t"
done
sync

# One round of one binary: prints "create stat unlink" as ops/s, µs of daemon CPU and
# context switches per operation.
round() {
    python3 - "$FS/$1" "$REL" "$FILES" "$LAYER_FILES" "${PID[$1]}" "$REPO" <<'EOF'
import glob, os, sys, time
mnt, rel, n, m, pid, repo = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]

def daemon():
    """CPU time (ns) and context switches of every thread of the daemon."""
    cpu = switches = 0
    for task in glob.glob("/proc/%s/task/*" % pid):
        try:
            with open(task + "/schedstat") as f:
                cpu += int(f.read().split()[0])
            with open(task + "/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        switches += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return cpu, switches

def measure(paths, op):
    c0, s0 = daemon()
    t = time.perf_counter()
    for p in paths:
        op(p)
    wall = time.perf_counter() - t
    c1, s1 = daemon()
    k = len(paths)
    return "%.0f %.1f %.2f" % (k / wall, (c1 - c0) / k / 1000, (s1 - s0) / k)

sys.path.insert(0, os.path.join(repo, "benches"))
import bench
# One CPU for the workload, as in run.sh (`META_CPU`).
bench.pin_workload()
d = os.path.join(mnt, "meta.%d" % os.getpid())
os.mkdir(d)
files = [os.path.join(d, "f%06d" % i) for i in range(n)]
layer = [os.path.join(mnt, rel, "f%06d" % i) for i in range(m)]
create = measure(files, lambda p: os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)))
bench.drop_caches()
stat = measure(layer, os.stat)
unlink = measure(files, os.unlink)
os.rmdir(d)
print(create, stat, unlink)
EOF
}

declare -A rows
for r in $(seq "$ROUNDS"); do
    order=("${BINS[@]}")
    [ $((r % 2)) = 0 ] && order=(new old)
    for t in "${order[@]}"; do
        rows[$t]+="$(round "$t");"
    done
done

python3 - "$FILES" "$LAYER_FILES" "$ROUNDS" "${rows[old]}" "${rows[new]}" <<'EOF'
import statistics, sys
files, layer, rounds = sys.argv[1], sys.argv[2], sys.argv[3]
runs = [[[float(x) for x in r.split()] for r in a.split(";") if r] for a in sys.argv[4:]]
rows = [("create (local dir, %s files)" % files, 0),
        ("cold stat (remote layer, %s files)" % layer, 3),
        ("unlink (local dir)", 6)]
print("metadata, medians of %s rounds: ops/s | daemon CPU µs/op | daemon context switches/op" % rounds)
print("| row | old | new | new / old (ops/s) |")
print("|---|---:|---:|---:|")
for label, i in rows:
    cells = []
    for rs in runs:
        ops, cpu, cs = (statistics.median(r[i + j] for r in rs) for j in range(3))
        cells.append((ops, "%.0f / %.1f / %.2f" % (ops, cpu, cs)))
    print("| %s | %s | %s | %.2f |" % (label, cells[0][1], cells[1][1], cells[1][0] / cells[0][0]))
EOF
