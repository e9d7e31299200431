#!/usr/bin/env bash
# The CSI driver's BackingImage copies against the tools that set the bar (DESIGN §7):
#   export: CreateSnapshot (raw) of a volume until ready_to_use, vs `sha512sum` of the volume's
#           disk file (target: <= 1.2x);
#   download: a raw image from a local HTTP server (python3 -m http.server on loopback) until
#           the image is ready (downloaded, checksummed, fsynced), vs `curl -o` of the same URL
#           to the same disk, in the same run (target: throughput >= 0.7x curl's; PASS/FAIL).
# Drives the real layerfs-csi binary over its gRPC socket (csi/examples/bench_client.rs).
# Needs root, python3, curl, qemu-img. See benches/README.md.
#
# Knobs (environment):
#   VOLUME=1G        size of the exported volume
#   WRITTEN=200      MiB of random data written into it (the rest stays holes)
#   IMAGE=1G         size of the downloaded image (random data)
#   REPEAT=3         rounds; medians shown
#   ONLY=            `export` or `download` to time only that row
#   PUBLISH=1        publish the exported volume (Block) during its snapshot, as a pod would
#                    have it, and report how long its writes were held for the cut; 0: not
#   SCRATCH=/var/tmp/layerfs-csi-bench   scratch area (a per-run subdir is created and removed)
#   LAYERFS_CSI=target/release/layerfs-csi   the driver (built if missing)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VOLUME=${VOLUME:-1G}
WRITTEN=${WRITTEN:-200}
IMAGE=${IMAGE:-1G}
REPEAT=${REPEAT:-3}
ONLY=${ONLY:-}
PUBLISH=${PUBLISH:-1}
case $ONLY in '' | export | download) ;; *) echo "csi-bench: ONLY is export or download" >&2; exit 2 ;; esac
SCRATCH=${SCRATCH:-/var/tmp/layerfs-csi-bench}
LAYERFS_CSI=${LAYERFS_CSI:-$REPO/target/release/layerfs-csi}
CLIENT=$REPO/target/release/examples/bench_client

log() { printf '[csi-bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'csi-bench: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (the driver refuses to start otherwise)"
for tool in python3 curl sha512sum qemu-img; do
    command -v "$tool" >/dev/null || die "$tool not found"
done
if [ ! -x "$CLIENT" ] || [ "$LAYERFS_CSI" = "$REPO/target/release/layerfs-csi" ]; then
    log "building: cargo build --release -p layerfs-csi --examples"
    (cd "$REPO" && cargo build --release -p layerfs-csi --bins --examples) >&2 \
        || die "cargo build failed"
fi
[ -x "$LAYERFS_CSI" ] || die "no driver at $LAYERFS_CSI"

mkdir -p "$SCRATCH"
RUN=$(mktemp -d "$SCRATCH/run.XXXXXX")
DRIVER_PID=
HTTP_PID=
CLIENT_PID=
cleanup() {
    set +e
    for pid in $CLIENT_PID $DRIVER_PID $HTTP_PID; do
        kill "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    rm -rf "$RUN"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

SOCKET=$RUN/csi.sock
STORE=$RUN/store
IMAGES=$RUN/images
start_driver() {
    local extra=()
    # Drivers before --allow-private-urls allowed loopback URLs without being told.
    "$LAYERFS_CSI" --help | grep -q -- --allow-private-urls && extra+=(--allow-private-urls)
    RUST_LOG=${RUST_LOG:-warn,layerfs_csi::cut=info} "$LAYERFS_CSI" --endpoint "unix://$SOCKET" --node-id bench --store "$STORE" \
        --backing-images "$IMAGES" --image-wait 1 "${extra[@]}" 2>"$RUN/driver.log" &
    DRIVER_PID=$!
    for _ in $(seq 200); do [ -S "$SOCKET" ] && return 0; sleep 0.05; done
    cat "$RUN/driver.log" >&2
    die "the driver did not start"
}
# In the background, so that a signal reaches the trap at once (bash runs traps only between
# commands, not while it waits for a foreground one).
client() {
    "$CLIENT" "$SOCKET" "$@" &
    CLIENT_PID=$!
    wait "$CLIENT_PID"
    CLIENT_PID=
}
seconds() { local t0 t1; t0=$(date +%s.%N); "$@" >/dev/null; t1=$(date +%s.%N); echo "$t1 - $t0" | bc -l; }
median() { sort -g | awk '{a[NR]=$1} END {m=(NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2; printf "%.3f\n", m}'; }

command -v bc >/dev/null || die "bc not found"
start_driver

# --- export ------------------------------------------------------------------------------------
export_sha=()
export_csi=()
[ "$ONLY" = download ] || for round in $(seq "$REPEAT"); do
    vol=$(client create-volume "bench-vol-$round" "$(numfmt --from=iec "$VOLUME")")
    disk=$STORE/volumes/$vol/disk.img
    [ -f "$disk" ] || die "no disk file for volume $vol at $disk"
    dd if=/dev/urandom of="$disk" bs=1M count="$WRITTEN" seek=100 conv=notrunc,fsync status=none
    sync
    sha512sum "$disk" >/dev/null # both start from a warm page cache
    export_sha+=("$(seconds sha512sum "$disk")")
    if [ "$PUBLISH" = 1 ]; then
        mkdir -p "$RUN/targets"
        client publish "$vol" "$RUN/targets/$vol" >/dev/null
    fi
    client snapshot "bench-snap-$round" "$vol" >"$RUN/took"
    export_csi+=("$(cat "$RUN/took")")
    [ "$PUBLISH" = 1 ] && client unpublish "$vol" "$RUN/targets/$vol" >/dev/null
    log "export round $round: sha512sum ${export_sha[-1]}s, CreateSnapshot until ready ${export_csi[-1]}s"
done

# --- download ----------------------------------------------------------------------------------
SERVE=$RUN/serve
mkdir -p "$SERVE"
head -c "$(numfmt --from=iec "$IMAGE")" /dev/urandom >"$SERVE/image.raw"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 -m http.server --bind 127.0.0.1 --directory "$SERVE" "$PORT" >"$RUN/http.log" 2>&1 &
HTTP_PID=$!
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$PORT/" && break; sleep 0.1; done
URL=http://127.0.0.1:$PORT/image.raw
bytes=$(stat -c %s "$SERVE/image.raw")
cat "$SERVE/image.raw" >/dev/null # the server reads from a warm page cache
dl_curl=()
dl_csi=()
dl_sha=()
[ "$ONLY" = export ] || for round in $(seq "$REPEAT"); do
    # The floor: a download is checksummed, and SHA-512 runs on one core.
    dl_sha+=("$(seconds sha512sum "$SERVE/image.raw")")
    dl_curl+=("$(seconds curl -s -f -o "$RUN/curl.raw" "$URL")")
    rm -f "$RUN/curl.raw"
    client download "bench-dl-$round" "$URL" "$IMAGES/bench-dl-$round.json" >"$RUN/took"
    dl_csi+=("$(cat "$RUN/took")")
    rm -f "$IMAGES/bench-dl-$round.img" # keep the scratch area small
    log "download round $round: curl ${dl_curl[-1]}s, sha512sum ${dl_sha[-1]}s, layerfs-csi ${dl_csi[-1]}s"
done

mib=$(echo "$bytes / 1048576" | bc -l)
echo
echo "driver: $LAYERFS_CSI ($REPEAT rounds, medians)"
if [ "$ONLY" != download ]; then
sha=$(printf '%s\n' "${export_sha[@]}" | median)
exp=$(printf '%s\n' "${export_csi[@]}" | median)
printf 'export  %s volume, %s MiB written: sha512sum %.3f s, CreateSnapshot raw until ready %.3f s, ratio %.2fx (target <= 1.2x)\n' \
    "$VOLUME" "$WRITTEN" "$sha" "$exp" "$(echo "$exp / $sha" | bc -l)"
# How long a published volume's writers were held out while each cut was taken (the driver
# logs it); a store with reflinks takes the cut without holding them.
if grep -aq 'cut taken by reflink' "$RUN/driver.log"; then
    echo 'export  cuts taken by reflink: writers were not held'
elif [ "$PUBLISH" = 1 ]; then
    pauses=$( (grep -ao 'pause_ms=[0-9.]*' "$RUN/driver.log" || true) | cut -d= -f2 | sort -n \
        | xargs -r printf '%.0f ')
    printf 'export  cut pauses of the published volume (writes held during the copy), ms: %s\n' \
        "${pauses:-none logged}"
fi
fi
[ "$ONLY" = export ] && exit 0
curl_s=$(printf '%s\n' "${dl_curl[@]}" | median)
csi_s=$(printf '%s\n' "${dl_csi[@]}" | median)
dl_sha_s=$(printf '%s\n' "${dl_sha[@]}" | median)
ratio=$(echo "$curl_s / $csi_s" | bc -l)
verdict=$(echo "$ratio >= 0.7" | bc -l | sed 's/1/PASS/; s/0/FAIL/')
printf 'download %s raw over loopback: curl -o %.3f s (%.0f MiB/s), layerfs-csi %.3f s (%.0f MiB/s), throughput ratio %.2fx (target >= 0.7x: %s)\n' \
    "$IMAGE" "$curl_s" "$(echo "$mib / $curl_s" | bc -l)" "$csi_s" "$(echo "$mib / $csi_s" | bc -l)" \
    "$ratio" "$verdict"
printf 'download floor: sha512sum of the image %.3f s (%.0f MiB/s); layerfs-csi / max(curl, sha512sum) = %.2fx\n' \
    "$dl_sha_s" "$(echo "$mib / $dl_sha_s" | bc -l)" \
    "$(echo "floor = $curl_s; if ($dl_sha_s > floor) floor = $dl_sha_s; $csi_s / floor" | bc -l)"
