//! A mount's way to the quotas of local's btrfs (see `kernel`): the limits and counts of
//! subvolumes' qgroups, through `store::btrfs`.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use tracing::info;

use super::table::Usage;
use crate::store::{self, btrfs};

/// How often, and how many times, the qgroup of a deleted root is tried.
const REAP_EVERY: std::time::Duration = std::time::Duration::from_millis(500);
const REAP_TRIES: u32 = 600;

/// A mount's way to btrfs's quotas: local's root, open for ioctls.
#[derive(Debug)]
pub(super) struct Qgroups {
    fd: OwnedFd,
}

impl Qgroups {
    /// For the local root `local`, if it is on btrfs.
    pub(super) fn of(local: BorrowedFd<'_>) -> Option<Qgroups> {
        if !btrfs::is_btrfs(local) {
            return None;
        }
        let fd = store::reopen(local, OFlag::O_RDONLY | OFlag::O_DIRECTORY).ok()?;
        Some(Qgroups { fd })
    }

    /// Limits the subvolume's qgroup to `bytes` (none: no limit), turning quotas on first
    /// if they are off.
    pub(super) fn limit(&self, subvolume: u64, bytes: Option<u64>) -> Result<(), Errno> {
        if bytes.is_some() {
            self.quotas_on()?;
        }
        btrfs::set_limit(self.fd.as_fd(), subvolume, bytes)
    }

    /// After the subvolume of a root was deleted: commits, which sets btrfs's cleaner to
    /// work on it at once (its space comes back in the background), and removes its qgroup
    /// once it is cleaned up, on a thread of its own. The kernel removes such a qgroup
    /// itself only when the subvolume's counts came down to nothing.
    pub(super) fn reap(&self, subvolume: u64) {
        if let Err(e) = btrfs::commit(self.fd.as_fd()) {
            tracing::warn!(error = %e, "committing local's btrfs after a quota root was deleted");
        }
        let Ok(fd) = self.fd.try_clone() else {
            return;
        };
        let reaper = move || {
            for _ in 0..REAP_TRIES {
                std::thread::sleep(REAP_EVERY);
                match btrfs::remove_qgroup(fd.as_fd(), subvolume) {
                    Ok(()) | Err(Errno::ENOENT) => return,
                    Err(Errno::EBUSY) => {
                        let _ = btrfs::commit(fd.as_fd());
                    }
                    Err(e) => {
                        tracing::warn!(subvolume, error = %e, "the qgroup of a deleted quota root stays");
                        return;
                    }
                }
            }
            tracing::warn!(
                subvolume,
                "the qgroup of a deleted quota root is still in use; it stays"
            );
        };
        if let Err(e) = std::thread::Builder::new()
            .name("qgroup-reaper".into())
            .spawn(reaper)
        {
            tracing::warn!(error = %e, "the qgroup of a deleted quota root stays");
        }
    }

    /// What the subvolume's qgroup counts, as of the last commit.
    pub(super) fn usage(&self, subvolume: u64) -> Result<Usage, Errno> {
        let counted = btrfs::qgroup(self.fd.as_fd(), subvolume)?;
        Ok(Usage {
            bytes: counted.referenced,
            inodes: 0,
        })
    }

    fn quotas_on(&self) -> Result<(), Errno> {
        let (mode, inconsistent) = btrfs::quota_mode(self.fd.as_fd())?;
        match mode {
            btrfs::QuotaMode::Off => {
                info!("turning btrfs quotas (full qgroups) on for local's filesystem");
                btrfs::enable_quota(self.fd.as_fd())?;
            }
            btrfs::QuotaMode::Simple => {
                info!("local's btrfs counts simple quotas: reflinked data is charged to the subvolume that first wrote it");
            }
            btrfs::QuotaMode::Full if inconsistent => {
                tracing::warn!("local's btrfs qgroup counts are marked inconsistent; `btrfs quota rescan` fixes them");
            }
            btrfs::QuotaMode::Full => {}
        }
        Ok(())
    }
}
