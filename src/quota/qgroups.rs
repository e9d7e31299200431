//! A mount's way to the quotas of local's btrfs (see `kernel`): the limits and counts of
//! subvolumes' qgroups, through `store::btrfs`.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use tracing::info;

use super::table::Usage;
use crate::store::{self, btrfs};

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

    /// Commits, which sets btrfs's cleaner to work on a deleted subvolume: its space comes
    /// back in the background, not at the next commit interval.
    pub(super) fn commit(&self) {
        if let Err(e) = btrfs::commit(self.fd.as_fd()) {
            tracing::warn!(error = %e, "committing local's btrfs after a quota root was deleted");
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
