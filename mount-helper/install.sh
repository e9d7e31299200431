#!/usr/bin/env bash
# Builds layerfs and its mount(8) helper and installs them where mount(8) finds helpers:
#   $PREFIX/bin/layerfs                 (PREFIX defaults to /usr/local)
#   $SBINDIR/mount.layerfs              (SBINDIR defaults to /sbin)
#   $SBINDIR/mount.fuse.layerfs -> mount.layerfs   (for -t fuse.layerfs)
# UNINSTALL=1 removes them again.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${PREFIX:-/usr/local}
sbindir=${SBINDIR:-/sbin}

if [ "${UNINSTALL:-0}" = 1 ]; then
    rm -f "$prefix/bin/layerfs" "$sbindir/mount.layerfs" "$sbindir/mount.fuse.layerfs"
    echo "removed layerfs, mount.layerfs and mount.fuse.layerfs"
    exit 0
fi

cargo build --release --workspace --quiet
install -D -m 0755 target/release/layerfs "$prefix/bin/layerfs"
install -D -m 0755 target/release/mount-layerfs "$sbindir/mount.layerfs"
ln -sf mount.layerfs "$sbindir/mount.fuse.layerfs"
echo "installed $prefix/bin/layerfs, $sbindir/mount.layerfs and $sbindir/mount.fuse.layerfs"
