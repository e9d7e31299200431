#!/bin/sh
# Runs kubernetes-csi/csi-test's csi-sanity against a fresh layerfs-csi.
#
#   csi/sanity.sh CSI_SANITY [mount|block] [LAYERFS_CSI]
#
# CSI_SANITY is a built csi-sanity binary (v5.2.0 and v5.4.0 are the versions checked; see
# docs/csi.md). LAYERFS_CSI defaults to target/release/layerfs-csi (an unoptimized build may
# checksum a fresh snapshot too slowly for csi-sanity, which never retries). Needs root (loop
# devices, mounts). Everything lives in a temp dir that is removed afterwards, with the driver stopped
# and its mounts and loop devices gone, also when csi-sanity fails. The exit status is
# csi-sanity's.
set -u
sanity=${1:?usage: csi/sanity.sh CSI_SANITY [mount|block] [LAYERFS_CSI]}
access=${2:-mount}
driver=${3:-target/release/layerfs-csi}
case $access in mount|block) ;; *) echo "access type must be mount or block" >&2; exit 2 ;; esac

dir=$(mktemp -d /tmp/layerfs-sanity.XXXXXX)
pid=
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    grep " $dir" /proc/self/mounts | cut -d' ' -f2 | sort -r | xargs -r -n1 umount -l
    losetup -l -n -O NAME,BACK-FILE | awk -v d="$dir" 'index($2, d) == 1 { print $1 }' |
        xargs -r -n1 losetup -d
    rm -rf "$dir"
}
trap cleanup EXIT INT TERM

printf 'type: bi\nexport-type: raw\n' > "$dir/snapshot-parameters.yaml"
"$driver" --endpoint "unix://$dir/csi.sock" --node-id node1 --store "$dir/store" \
    2> "$dir/driver.log" &
pid=$!
i=0
while [ ! -S "$dir/csi.sock" ]; do
    i=$((i + 1))
    if [ $i -gt 200 ]; then echo "the driver never listened" >&2; cat "$dir/driver.log" >&2; exit 1; fi
    sleep 0.1
done

"$sanity" \
    --csi.endpoint "unix://$dir/csi.sock" \
    --csi.mountdir "$dir/mnt" \
    --csi.stagingdir "$dir/stage" \
    --csi.testvolumesize 67108864 \
    --csi.testvolumeaccesstype "$access" \
    --csi.testsnapshotparameters "$dir/snapshot-parameters.yaml"
status=$?
# What the driver left in its store once every test deleted what it made.
echo "left in the BackingImage and cut directories:"
ls -A "$dir/store/backing-images" "$dir/store/cuts"
exit $status
