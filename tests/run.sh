#!/usr/bin/env bash
# Runs the whole test suite, FUSE mounts included. Needs root and /dev/fuse; installs the
# Debian packages the tests use when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "tests/run.sh: the tests mount filesystems; run as root (e.g. sudo $0)" >&2
    exit 1
fi

missing=()
command -v fusermount3 >/dev/null || missing+=(fuse3)
command -v mount >/dev/null || missing+=(mount)
command -v qemu-img >/dev/null || missing+=(qemu-utils)
command -v mkfs.ext4 >/dev/null || missing+=(e2fsprogs)
# A CSI store with reflinks (csi/tests/point_in_time.rs).
command -v mkfs.xfs >/dev/null || missing+=(xfsprogs)
command -v losetup >/dev/null || missing+=(util-linux)
command -v setfacl >/dev/null || missing+=(acl)
# A remote that stalls: a FUSE carrier to freeze, and sshfs to a test's own sshd.
command -v fuse-overlayfs >/dev/null || missing+=(fuse-overlayfs)
command -v sshfs >/dev/null || missing+=(sshfs)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ssh-keygen >/dev/null || missing+=(openssh-client)
# Container runtimes with their storage on the view (tests/runtimes.rs), and the static
# busybox their image is built from.
command -v podman >/dev/null || missing+=(podman)
command -v containerd >/dev/null || missing+=(containerd)
command -v runc >/dev/null || missing+=(runc)
# Static, as the image has no libc: Debian's busybox-static, not busybox.
dpkg -s busybox-static >/dev/null 2>&1 || missing+=(busybox-static)
# A registry on 127.0.0.1 for the CRI pull through the layerfs snapshotter.
command -v docker-registry >/dev/null || missing+=(docker-registry)
# A local on btrfs (tests/quota_data.rs).
command -v mkfs.btrfs >/dev/null || missing+=(btrfs-progs)
# fio writes and verifies under a daemon killed again and again (tests/restart.rs).
command -v fio >/dev/null || missing+=(fio)
# systemd-analyze checks the shipped units (tests/systemd_units.sh).
command -v systemd-analyze >/dev/null || missing+=(systemd)
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
[ -e /dev/fuse ] || modprobe fuse 2>/dev/null || true
if [ ! -c /dev/fuse ]; then
    echo "tests/run.sh: /dev/fuse is missing; FUSE tests cannot run here" >&2
    exit 1
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo test --workspace --all-targets --no-fail-fast

# The same tests with the kernel offering FUSE over io_uring, which every mount without a
# keeper then takes by default: the ring must keep every guarantee /dev/fuse keeps.
uring=/sys/module/fuse/parameters/enable_uring
if [ "${LAYERFS_TEST_TRANSPORTS:-dev,uring}" != dev ] && [ -w "$uring" ]; then
    offered=$(cat "$uring")
    trap 'echo "$offered" > "$uring"' EXIT
    echo Y > "$uring"
    echo "the tests again, over FUSE over io_uring"
    cargo test --workspace --all-targets --no-fail-fast
fi
bash tests/systemd_units.sh
