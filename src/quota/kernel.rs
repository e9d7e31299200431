//! Quota roots the kernel enforces (DESIGN §6): with local on btrfs, a root is a subvolume
//! whose qgroup carries the limit. The kernel counts every write, those done with FUSE
//! passthrough included, so files in such a root keep passthrough, and the data path of
//! the daemon does nothing for them. An allocation past the limit fails with the kernel's
//! `EDQUOT` (`quota_errno` applies to the FUSE backend only).
//!
//! Full qgroups, not simple quotas: simple quotas charge an extent to the subvolume that
//! first allocated it, so a directory converted by reflink (and any reflink into a root)
//! would hold data its root is never charged for. Full qgroups count what each subvolume
//! references; without snapshots, their cost at commit stays small. A filesystem whose
//! quotas are already on is used in the mode it has.
//!
//! btrfs has no inode limits: under `quota_backend=auto`, a root asked for one is enforced
//! by the FUSE backend.

use std::os::fd::{AsFd, BorrowedFd};

use nix::errno::Errno;
use nix::fcntl::OFlag;

use super::backend::Choice;
use super::error::QuotaError;
use super::ledger::Ledger;
use super::table::{Limit, QuotaRoot, Usage};
use crate::store::{self, btrfs};

impl Ledger {
    /// Whether a new root over the local directory `local` with `limit` is enforced by
    /// btrfs, as `quota_backend` asks.
    pub(super) fn wants_btrfs(
        &self,
        local: BorrowedFd<'_>,
        limit: Limit,
        shown: &str,
    ) -> Result<bool, QuotaError> {
        let on_btrfs = self.btrfs.is_some() && btrfs::is_btrfs(local);
        match self.choice {
            Choice::Fuse => Ok(false),
            Choice::Auto => Ok(on_btrfs && limit.inodes.is_none()),
            Choice::Btrfs if !on_btrfs => Err(QuotaError::Backend {
                path: shown.to_owned(),
                reason: "quota_backend=btrfs, but local is not on btrfs".into(),
            }),
            Choice::Btrfs if limit.inodes.is_some() => Err(no_inode_limits(shown)),
            Choice::Btrfs => Ok(true),
        }
    }

    /// The kernel's limit of a btrfs root is set to `bytes` (none: taken away).
    pub(super) fn kernel_limit(&self, root: &QuotaRoot, bytes: Option<u64>) -> Result<(), Errno> {
        match (root.subvolume(), &self.btrfs) {
            (Some(subvolume), Some(btrfs)) => btrfs.limit(subvolume, bytes),
            (None, _) => Ok(()),
            (Some(_), None) => Err(Errno::EOPNOTSUPP),
        }
    }

    /// What a root holds: counted by the kernel for a btrfs root, else by the ledger.
    pub(super) fn usage_of(&self, root: &QuotaRoot) -> Usage {
        match (root.subvolume(), &self.btrfs) {
            (Some(subvolume), Some(btrfs)) => btrfs.usage(subvolume).unwrap_or_else(|e| {
                tracing::warn!(path = %root.path().display(), error = %e, "reading a btrfs qgroup");
                Usage::default()
            }),
            _ => root.usage(),
        }
    }

    /// The btrfs root `root` was removed with its subvolume: its space comes back sooner,
    /// and its qgroup goes.
    pub(super) fn removed_subvolume(&self, root: &QuotaRoot) {
        if let (Some(btrfs), Some(subvolume)) = (&self.btrfs, root.subvolume()) {
            btrfs.reap(subvolume);
        }
    }

    /// Makes the btrfs subvolume `local` (a directory of local's btrfs) a kernel-enforced
    /// root of `limit`: its subvolume id, once the limit is in force.
    pub(super) fn limit_subvolume(
        &self,
        local: BorrowedFd<'_>,
        limit: Limit,
        shown: &str,
    ) -> Result<u64, QuotaError> {
        let sys = |source| QuotaError::Sys {
            path: shown.to_owned(),
            source,
        };
        let btrfs = self.btrfs.as_ref().ok_or_else(|| sys(Errno::EOPNOTSUPP))?;
        let fd = store::reopen(local, OFlag::O_RDONLY | OFlag::O_DIRECTORY).map_err(sys)?;
        let subvolume = btrfs::subvolume_id(fd.as_fd()).map_err(sys)?;
        btrfs.limit(subvolume, Some(limit.bytes)).map_err(sys)?;
        Ok(subvolume)
    }
}

pub(super) fn no_inode_limits(shown: &str) -> QuotaError {
    QuotaError::Backend {
        path: shown.to_owned(),
        reason: "btrfs quotas cannot limit inodes (quota_backend=fuse can)".into(),
    }
}
