//! Starting and ending the session: what the daemon asks of the kernel at `init`.

use super::*;

impl Core {
    pub(super) fn init(&self, config: &mut KernelConfig) -> std::io::Result<()> {
        let offered = config.capabilities();
        let wanted = [
            // Lookups and readdirs of one directory may run in parallel: the view is
            // thread-safe and the kernel still serializes changes to a directory.
            InitFlags::FUSE_PARALLEL_DIROPS,
            // A symlink's target never changes: cache it.
            InitFlags::FUSE_CACHE_SYMLINKS,
            // Direct-I/O opens (see backing.rs) can still be mmapped.
            InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP,
            // The kernel enforces POSIX ACLs (read through getxattr) and leaves the umask
            // to the daemon, which creates as the caller so that local's filesystem
            // applies a directory's default ACL instead of the umask, as it would.
            InitFlags::FUSE_POSIX_ACL,
            InitFlags::FUSE_DONT_MASK,
            // Set-ID bits are the daemon's to clear: the kernel asks with an empty SETATTR
            // (before a write, passthrough ones included, fallocate or copy) or a write
            // flag, having decided with the caller's credentials, and the daemon applies
            // the whole rule, which the kernel's own fallback for FUSE only half applies
            // (it keeps a setgid bit without group-execute that a non-member must lose).
            InitFlags::FUSE_HANDLE_KILLPRIV_V2,
            // File handles: LOOKUPs of `.` and `..` find nodes the kernel has forgotten
            // (see `view::exports`).
            InitFlags::FUSE_EXPORT_SUPPORT,
        ];
        // Not FUSE_ATOMIC_O_TRUNC: with it, the daemon would truncate while serving the OPEN,
        // before the kernel decides whether the open may truncate at all (a running
        // executable: ETXTBSY; a security module: EACCES). A refused open would then have
        // emptied the file. Without it, the truncation comes as a SETATTR after those checks;
        // a remote file opened for writing is copied up by its first change, so the SETATTR
        // of a truncating open copies no data (see `View::open`).
        for flag in wanted {
            if offered.contains(flag) {
                let _ = config.add_capabilities(flag);
            }
        }
        // Offered, not asked for: the kernel takes expire-only notices when it has them.
        self.notices
            .set_expire_only(offered.contains(InitFlags::FUSE_HAS_EXPIRE_ONLY));
        if self.want_passthrough && offered.contains(InitFlags::FUSE_PASSTHROUGH) {
            // Depth 1 leaves room for overlayfs on top of the view (the container rootfs
            // iSulad mounts from `<driver>/l/` links).
            if config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(1).is_ok()
            {
                self.passthrough.store(true, Ordering::Relaxed);
            }
        }
        // Not offered: the mount says so where it was asked for (see `mount`).
        if self.want_ring && offered.contains(InitFlags::FUSE_OVER_IO_URING) {
            // A ring entry's payload holds the largest request: keep max_write at the
            // kernel's default page limit (256 pages), which caps it anyway.
            let _ = config.set_max_write(ring::MAX_WRITE);
            let _ = config.add_capabilities(InitFlags::FUSE_OVER_IO_URING);
            self.ring.store(true, Ordering::Relaxed);
        }
        info!(
            io_uring = self.ring.load(Ordering::Relaxed),
            passthrough = self.passthrough.load(Ordering::Relaxed),
            "FUSE session initialized"
        );
        Ok(())
    }

    pub(super) fn destroy(&self) {
        // The last request of an unmount: what was written through the view reaches the
        // disk before the daemon says it is done.
        match self.view.sync_local() {
            Ok(()) => info!("local tree synced"),
            Err(e) => tracing::warn!(error = %e, "syncing the local tree at unmount failed"),
        }
    }
}
